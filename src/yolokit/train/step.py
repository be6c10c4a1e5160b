"""One micro-batch's forward, loss and backward: the step the trainer, the batch finder's probe
and the GPU benchmarks all take, written once."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from yolokit.accel.amp import Precision


def forward_backward(net: nn.Module, criterion: nn.Module, precision: Precision, images: Tensor, targets: Tensor,
                     *, max_boxes: int | None, weight: float, channels_last: bool) -> tuple[Tensor, dict[str, Tensor]]:
    """Backpropagates ``loss * weight`` of one micro-batch under ``precision``.

    Args:
        net: the network to train (possibly compiled or wrapped).
        criterion: ``criterion(maps, targets, max_boxes=...)`` -> ``(loss, parts)``.
        precision: autocast and (scaled) backward.
        images: Tensor[B, 3, H, W] float on the device.
        targets: Tensor[N, 6] on the device.
        max_boxes: most boxes of one image in the batch (the loss pads to it), or None.
        weight: this micro-batch's share of the step (the trainer passes its image count,
            Ultralytics' ``loss * batch``).
        channels_last: lay the images out NHWC first.

    Returns:
        ``(loss, parts)``: the unweighted loss, detached, and the loss's named parts.
    """
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    with precision.autocast():
        loss, parts = criterion(net(images), targets, max_boxes=max_boxes)
    precision.backward(loss * weight)
    return loss.detach(), parts
