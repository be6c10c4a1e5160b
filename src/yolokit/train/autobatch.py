"""The run's total batch: a number that divides among the processes, or "auto", measured once.

``batch="auto"`` probes real training steps at the dataset's worst case: square images of
the training size, each holding the most boxes a training image can hold (the most boxes of
one labelled image, times 4 with Mosaic and 2 with MixUp), with the gradients, the EMA and
the optimizer's state allocated as the run will have them. It fits peak memory against
batch size from a few small probes, takes the size whose peak is ``AUTO_FRACTION`` of the
memory the device has for this process, checks it with one more step (and searches below
it if that step runs out of memory), prints what it tried, and leaves no gradient,
optimizer state or BatchNorm statistic behind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from yolokit.accel import distributed
from yolokit.accel.amp import Precision
from yolokit.accel.batch_size import free_memory, measure_peak_memory, predict_batch_size
from yolokit.data import DetectionDataset
from yolokit.train.config import TrainConfig
from yolokit.train.step import forward_backward

AUTO_FRACTION = 0.8   # of the device memory free for this process when the run starts
CPU_AUTO_BATCH = 16
PROBE_SIZES = (1, 2, 4, 8)


def resolve_batch(cfg: TrainConfig, probe: Callable[[int], None] | None, device: torch.device, *,
                  resumed: dict[str, Any] | None = None,
                  memory: tuple[float, Callable[[int], float]] | None = None,
                  report: Callable[[str], None] = print) -> int:
    """Total images per loader batch over all processes.

    A number must divide by the number of processes (each runs ``batch / world``).
    ``"auto"`` is measured on every process, the smallest fit is taken by all, and the
    result is stored in the run's checkpoints: a resumed run reuses it without measuring.

    Args:
        cfg: The run's config (``batch``).
        probe: ``probe(b)`` runs one worst-case training step of ``b`` images (see
            :func:`training_probe`); needed for ``"auto"``.
        device: This process's device; without CUDA (and without ``memory``) nothing is
            measured and ``CPU_AUTO_BATCH`` images are shared among the processes.
        resumed: The checkpoint being resumed, if any.
        memory: ``(budget_bytes, peak_bytes(b))`` instead of CUDA's own readings (tests).
        report: receives the finder's lines (print by default; the trainer routes them to
            its callbacks' ``on_setup_end``).

    Returns:
        The total batch, a multiple of the world size.
    """
    world = distributed.world_size()
    if cfg.batch != "auto":
        batch = int(cfg.batch)
        if batch % world:
            raise ValueError(f"batch {batch} is the total over all processes and must divide by their number "
                             f"({world}); try batch {max(world, batch // world * world)}")
        return batch
    if resumed is not None and resumed.get("batch"):
        return int(resumed["batch"])
    per_rank = measure_batch(probe, device, memory=memory, report=report)
    smallest = min(distributed.all_gather_object(per_rank))
    if distributed.is_main():
        report(f"batch auto: {smallest} images per process ({smallest * world} in all)")
    return smallest * world


def measure_batch(probe: Callable[[int], None], device: torch.device, *, fraction: float = AUTO_FRACTION,
                  max_size: int = 1024, memory: tuple[float, Callable[[int], float]] | None = None,
                  report: Callable[[str], None] = print) -> int:
    """Images per step whose peak memory is ``fraction`` of the budget (see the module docstring).

    Without CUDA and without ``memory`` nothing is measured: ``CPU_AUTO_BATCH`` images
    shared among the processes. ``report`` receives what was tried (the main process's
    line when nothing is measured).
    """
    if memory is None and device.type != "cuda":
        per_rank = max(1, CPU_AUTO_BATCH // distributed.world_size())
        if distributed.is_main():
            report(f"batch auto: no CUDA device to measure, using {per_rank} per process")
        return per_rank
    if memory is None:
        free, _ = torch.cuda.mem_get_info(device)
        budget = float(free + torch.cuda.memory_reserved(device))   # what this process may use
        peak = lambda b: float(measure_peak_memory(probe, b, device=device))  # noqa: E731
    else:
        budget, peak = memory
    tried: list[str] = []

    def measured(b: int) -> float:
        value = peak(b)
        tried.append(f"{b}: {value / 2**20:.0f} MiB")
        return value

    def checked(b: int) -> None:
        try:
            probe(b)
        except Exception:
            tried.append(f"{b}: out of memory")
            raise
        tried.append(f"{b}: fits")

    size = predict_batch_size(checked, fraction=fraction, probe_sizes=PROBE_SIZES, max_size=max_size,
                              total_bytes=budget, measure=measured)
    report(f"batch auto on {device}: budget {fraction:.0%} of {budget / 2**30:.2f} GiB; tried "
          f"{', '.join(tried)} -> {size} images per step")
    return size


def worst_case_boxes(dataset: DetectionDataset, cfg: TrainConfig) -> int:
    """Most boxes one training image can hold: the busiest labelled image, x4 with Mosaic, x2 with MixUp."""
    most = max((len(labels) for labels in dataset.index.labels), default=0)
    return max(1, most * (4 if cfg.augment.mosaic > 0 else 1) * (2 if cfg.augment.mixup > 0 else 1))


def training_probe(model: nn.Module, train_net: nn.Module, criterion: nn.Module, precision: Precision,
                   device: torch.device, *, imgsz: int, max_boxes: int, state_tensors: int,
                   channels_last: bool, seed: int = 0) -> Callable[[int], None]:
    """``probe(b)``: forward, loss and backward of ``b`` worst-case images, as the run would do them.

    Every probe starts with the gradients allocated (accumulation keeps them) and
    ``state_tensors`` zero tensors per parameter held as the optimizer's state (2 for
    AdamW, 1 for SGD with momentum), and ends with both released and the model's
    buffers (BatchNorm statistics) as they were.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = [b for b in model.buffers()]

    def probe(b: int) -> None:
        saved = [t.clone() for t in buffers]
        state = [torch.zeros_like(p) for p in params for _ in range(state_tensors)]
        try:
            for p in params:
                p.grad = torch.zeros_like(p)
            gen = torch.Generator(device=device).manual_seed(seed)
            images = torch.rand(b, 3, imgsz, imgsz, device=device, generator=gen)
            forward_backward(train_net, criterion, precision, images, _targets(b, max_boxes, imgsz, device, gen),
                             max_boxes=max_boxes, weight=b, channels_last=channels_last)
        finally:
            for p in params:
                p.grad = None
            with torch.no_grad():
                for t, value in zip(buffers, saved, strict=True):
                    t.copy_(value)
            del state
            free_memory()

    return probe


def _targets(b: int, boxes: int, imgsz: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """Tensor[b * boxes, 6] of random boxes from 4 to imgsz / 2 pixels, ``boxes`` per image."""
    n = b * boxes
    size = 4 + torch.rand(n, 2, device=device, generator=gen) * (imgsz / 2 - 4)
    corner = torch.rand(n, 2, device=device, generator=gen) * (imgsz - size)
    image = torch.arange(b, device=device).repeat_interleave(boxes).float()
    cls = torch.zeros(n, device=device)
    return torch.cat([image[:, None], cls[:, None], corner, corner + size], 1)
