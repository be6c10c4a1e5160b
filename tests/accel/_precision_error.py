"""Relative error of a model's outputs under a precision against fp32 (a test helper)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from yolokit.accel.amp import Precision


def _tensors(out: Any) -> Iterator[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, dict):
        for v in out.values():
            yield from _tensors(v)
    elif isinstance(out, (list, tuple)):
        for v in out:
            yield from _tensors(v)


@torch.no_grad()
def prediction_error(
    model: nn.Module,
    precision: str | Precision,
    *,
    imgsz: int | tuple[int, int] = 64,
    batch: int = 2,
    channels: int = 3,
    inputs: torch.Tensor | None = None,
    forward: Callable[[nn.Module, torch.Tensor], Any] | None = None,
    seed: int = 0,
) -> float:
    """Relative error of the model's outputs under ``precision`` against fp32.

    The model runs in eval mode on a generated input (uniform in [0, 1], seeded) and
    its train/eval flags are restored afterwards.

    Args:
        model: Module to test, already on its device.
        precision: A precision name or a :class:`Precision`.
        imgsz: Input size ``S`` or ``(H, W)`` of the generated Tensor[B, channels, H, W].
        batch: Batch size ``B`` of the generated input.
        channels: Channels of the generated input.
        inputs: Use this input instead of generating one.
        forward: ``forward(model, x)`` returning a tensor or nested list/dict of tensors;
            defaults to ``model(x)``.
        seed: Seed for the generated input.

    Returns:
        The largest ``||y_lp - y_fp32|| / ||y_fp32||`` over output tensors; ``inf`` when
        the low-precision output holds inf/NaN.
    """
    device = next(model.parameters()).device
    prec = precision if isinstance(precision, Precision) else Precision(precision, device)
    if inputs is None:
        h, w = (imgsz, imgsz) if isinstance(imgsz, int) else imgsz
        gen = torch.Generator().manual_seed(seed)
        inputs = torch.rand(batch, channels, h, w, generator=gen)
    inputs = inputs.to(device)
    run = forward or (lambda m, x: m(x))
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.autocast(device.type, enabled=False):
            ref = [t.float() for t in _tensors(run(model, inputs))]
        with prec.autocast():
            low = [t.float() for t in _tensors(run(model, inputs))]
    finally:
        for m, mode in modes:
            m.training = mode
    err = 0.0
    for a, b in zip(low, ref, strict=True):
        if not torch.isfinite(a).all():
            return float("inf")
        err = max(err, float((a - b).norm() / b.norm().clamp_min(1e-12)))
    return err
