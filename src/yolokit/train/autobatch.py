"""The run's total batch: a number that divides among the processes, or "auto", measured once."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from yolokit.accel import distributed
from yolokit.accel.amp import Precision
from yolokit.accel.batch_size import find_batch_size
from yolokit.train.config import TrainConfig

CPU_AUTO_BATCH = 16


def resolve_batch(cfg: TrainConfig, model: nn.Module, criterion: nn.Module, precision: Precision,
                  device: torch.device, *, resumed: dict[str, Any] | None = None) -> int:
    """Total images per loader batch over all processes.

    A number must divide by the number of processes (each runs ``batch / world``).
    ``"auto"`` is measured on every process, the smallest fit is taken by all, and the
    result is stored in the run's checkpoints: a resumed run reuses it without measuring.

    Args:
        cfg: The run's config (``batch``, ``imgsz``).
        model, criterion, precision, device: What a training step runs.
        resumed: The checkpoint being resumed, if any.

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
    per_rank = _measure(cfg, model, criterion, precision, device)
    smallest = min(distributed.all_gather_object(per_rank))
    if distributed.is_main():
        print(f"batch auto: {smallest} images per process fit ({smallest * world} in all)")
    return smallest * world


def _measure(cfg: TrainConfig, model: nn.Module, criterion: nn.Module, precision: Precision,
             device: torch.device) -> int:
    """Images per process that fit one training step on this device."""
    if device.type != "cuda":
        per_rank = max(1, CPU_AUTO_BATCH // distributed.world_size())
        if distributed.is_main():
            print(f"batch auto: no CUDA device to measure, using {per_rank} per process")
        return per_rank
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    def step(b: int) -> None:
        images = torch.rand(b, 3, cfg.imgsz, cfg.imgsz, device=device)
        targets = torch.tensor([[i, 0, 10.0, 10.0, 100.0, 100.0] for i in range(b)], device=device)
        with precision.autocast():
            loss, _ = criterion(model(images), targets)
        loss.backward()
        model.zero_grad(set_to_none=True)

    size = find_batch_size(step, start=1, max_size=512, mode="binsearch")
    model.load_state_dict(saved)
    return size
