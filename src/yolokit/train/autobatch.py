"""The run's total batch: a number that divides among the processes, or "auto", measured once.

``batch="auto"`` probes real training steps at the dataset's worst case: square images of
the training size (with ``multi_scale``, the largest size a step can draw, 1.5x; rect batches
are at most the training size), each holding the most boxes a training image can hold (the
most boxes of one labelled image, times 4 with Mosaic and 2 with MixUp, which rect leaves
out), with the gradients, the EMA and the optimizer's state allocated as the run will have
them. A probe also holds what the run adds around a step: with several processes the flat
buffers of the gradient all-reduce (as large as the gradients) and SyncBatchNorm's gathered
statistics, and it runs validation's forward at its batch (twice the training batch, without
gradients, at the training size).

Each probe size runs twice and the second run is measured (the first pays for cuDNN's
algorithm search, workspaces and first-call allocations). Peak memory is fitted against
batch size from 4 small sizes (1, 2, 4, 8); the size whose predicted peak is ``AUTO_FRACTION``
(0.95) of the memory the device has for this process is measured in turn, the line through it
and the largest probe predicts again, and a step of that size checks it when it is larger (a
search below follows if it runs out of memory): 5 or 6 sizes tried
(`yolokit.accel.predict_batch_size` with ``refine``). It prints what it tried, and leaves no
gradient, optimizer state or BatchNorm statistic behind.

What to expect: the true largest batch (the first size that runs out of memory) fills the device;
the memory line through small probes over-reads the cost of an image by about 2% (199.6 against
194.9 MiB for yolov8s on an H100), which the measured first prediction corrects. The result is
then ``AUTO_FRACTION`` of the true largest batch less what the fixed part (weights, optimizer
state) takes of it (``(0.95 budget - fixed) / (budget - fixed)``; 0.949 for yolov8s on an H100,
whose fixed part is 0.2 GiB). At 0.9 the first H100 pass found 362 of 412 images (0.879): the
default was raised to 0.95 from that. The rest is headroom for batches the probe does not
foresee; a step that still runs out of memory is split and replayed with the same effective batch
(:class:`yolokit.accel.Accumulator`).
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

AUTO_FRACTION = 0.95  # of the device memory free for this process when the run starts (see the module docstring)
CPU_AUTO_BATCH = 16
PROBE_SIZES = (1, 2, 4, 8)


def resolve_batch(cfg: TrainConfig, probe: Callable[[int], None] | None, device: torch.device, *, world: int,
                  main: bool, resumed: dict[str, Any] | None = None,
                  memory: tuple[float, Callable[[int], float]] | None = None,
                  report: Callable[[str], None] = print) -> int:
    """Total images per loader batch over all processes (the runtime plan checks that it divides).

    ``"auto"`` is measured on every process, the smallest fit is taken by all, and the
    result is stored in the run's checkpoints: a resumed run reuses it without measuring.

    Args:
        cfg: The run's config (``batch``).
        probe: ``probe(b)`` runs one worst-case training step of ``b`` images (see
            :func:`training_probe`); needed for ``"auto"``.
        device: This process's device; without CUDA (and without ``memory``) nothing is
            measured and ``CPU_AUTO_BATCH`` images are shared among the processes.
        world: Number of processes (the run's :class:`~yolokit.train.plan.Processes`).
        main: Whether this process reports (rank 0).
        resumed: The checkpoint being resumed, if any.
        memory: ``(budget_bytes, peak_bytes(b))`` instead of CUDA's own readings (tests).
        report: receives the finder's lines (print by default; the trainer routes them to
            its callbacks' ``on_setup_end``).

    Returns:
        The total batch.
    """
    if cfg.batch != "auto":
        return int(cfg.batch)
    if resumed is not None and resumed.get("batch"):
        return int(resumed["batch"])
    per_rank = measure_batch(probe, device, world=world, main=main, memory=memory, report=report)
    smallest = min(distributed.all_gather_object(per_rank))
    if main:
        report(f"batch auto: {smallest} images per process ({smallest * world} in all)")
    return smallest * world


def measure_batch(probe: Callable[[int], None], device: torch.device, *, world: int = 1, main: bool = True,
                  fraction: float = AUTO_FRACTION, max_size: int = 1024,
                  memory: tuple[float, Callable[[int], float]] | None = None,
                  report: Callable[[str], None] = print) -> int:
    """Images per step whose peak memory is ``fraction`` of the budget (see the module docstring).

    Without CUDA and without ``memory`` nothing is measured: ``CPU_AUTO_BATCH`` images
    shared among the ``world`` processes. ``report`` receives what was tried (the main
    process's line when nothing is measured).
    """
    if memory is None and device.type != "cuda":
        per_rank = max(1, CPU_AUTO_BATCH // world)
        if main:
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
    """Most boxes one training image can hold: the busiest labelled image, x4 with Mosaic, x2 with MixUp
    (neither with ``rect``)."""
    most = max((len(labels) for labels in dataset.index.labels), default=0)
    mosaic, mixup = (cfg.augment.mosaic > 0 and not cfg.rect), (cfg.augment.mixup > 0 and not cfg.rect)
    return max(1, most * (4 if mosaic else 1) * (2 if mixup else 1))


def training_probe(model: nn.Module, train_net: nn.Module, criterion: nn.Module, precision: Precision,
                   device: torch.device, *, imgsz: int, max_boxes: int, state_tensors: int,
                   channels_last: bool, seed: int = 0, world: int = 1, sync_bn: bool = False,
                   val_batch_factor: int = 2, val_imgsz: int | None = None) -> Callable[[int], None]:
    """``probe(b)``: a training step of ``b`` worst-case images and validation's forward, as the run does them.

    Every probe starts with the gradients allocated (accumulation keeps them) and
    ``state_tensors`` zero tensors per parameter held as the optimizer's state (2 for
    AdamW, 1 for SGD with momentum). With ``world`` > 1 it then holds the gradient
    all-reduce's flat buffers (one more copy of the gradients), and with ``sync_bn``,
    for the step, SyncBatchNorm's gathered statistics (``world + 2`` pairs of mean and
    variance per layer). Then validation's forward of ``val_batch_factor * b`` images of
    ``val_imgsz`` (default ``imgsz``; multi-scale training probes a larger ``imgsz`` than
    validation's) runs in eval mode without gradients. It ends with all of that released and the model's
    buffers (BatchNorm statistics) and mode as they were.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = [b for b in model.buffers()]
    bn_channels = sum(m.num_features for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))
    gathered = 2 * (world + 2) * bn_channels if sync_bn else 0

    def probe(b: int) -> None:
        saved, training = [t.clone() for t in buffers], model.training
        state = [torch.zeros_like(p) for p in params for _ in range(state_tensors)]
        held: list[torch.Tensor] = [torch.zeros(gathered, device=device)] if gathered else []
        try:
            for p in params:
                p.grad = torch.zeros_like(p)
            gen = torch.Generator(device=device).manual_seed(seed)
            images = torch.rand(b, 3, imgsz, imgsz, device=device, generator=gen)
            forward_backward(train_net, criterion, precision, images, _targets(b, max_boxes, imgsz, device, gen),
                             max_boxes=max_boxes, weight=b, channels_last=channels_last,
                             masks=_masks(criterion, b, max_boxes, imgsz, device))
            del images
            if world > 1:                    # accel.reduce.all_reduce_gradients: every bucket at once
                held.append(torch.empty(sum(p.numel() for p in params), device=device, dtype=params[0].dtype))
            for p in params:                 # validation runs after the step: gradients released
                p.grad = None
            held.clear()
            _validation_forward(model, val_batch_factor * b, val_imgsz or imgsz, device, channels_last)
        finally:
            for p in params:
                p.grad = None
            with torch.no_grad():
                for t, value in zip(buffers, saved, strict=True):
                    t.copy_(value)
            model.train(training)
            del state, held
            free_memory()

    return probe


@torch.inference_mode()
def _validation_forward(model: nn.Module, b: int, imgsz: int, device: torch.device, channels_last: bool) -> None:
    """What ``train.evaluate.validate`` runs on the device for a batch: forward and decode, in eval mode."""
    model.eval()
    images = torch.zeros(b, 3, imgsz, imgsz, device=device)
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    model.decode(model(images))


def _masks(criterion: nn.Module, b: int, boxes: int, imgsz: int, device: torch.device) -> torch.Tensor | None:
    """A segmentation loss's masks at the default ratio 4 (one index map per image, or one mask per box), empty:
    what they cost does not depend on what they hold; None for a detection loss."""
    loss = getattr(criterion, "_orig_mod", criterion)
    if not getattr(loss, "num_masks", None):
        return None
    side = max(1, imgsz // 4)
    return torch.zeros(b if loss.overlap else b * boxes, side, side, dtype=torch.uint8, device=device)


def _targets(b: int, boxes: int, imgsz: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """Tensor[b * boxes, 6] of random boxes from 4 to imgsz / 2 pixels, ``boxes`` per image."""
    n = b * boxes
    size = 4 + torch.rand(n, 2, device=device, generator=gen) * (imgsz / 2 - 4)
    corner = torch.rand(n, 2, device=device, generator=gen) * (imgsz - size)
    image = torch.arange(b, device=device).repeat_interleave(boxes).float()
    cls = torch.zeros(n, device=device)
    return torch.cat([image[:, None], cls[:, None], corner, corner + size], 1)
