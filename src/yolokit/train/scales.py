"""Multi-scale training: a random input size per optimizer step, the same on every rank.

The size of step ``k`` of epoch ``e`` is drawn from a numpy Generator seeded with
``(seed, e, k)`` only: every rank, and a run resumed at any step, draws the same size with no
communication. It is ``round(uniform(0.5, 1.5) * imgsz / stride) * stride``, kept within
:func:`size_range` (multiples of the model's largest stride within 0.5x to 1.5x ``imgsz``, at
least one stride). Every micro-batch of the step is resized on the device
(:func:`resize_batch`: bilinear, ``align_corners=False``) and its target boxes, which are in
input pixels, are scaled by the same factors. A rect batch keeps its aspect: its long side
becomes the size and its short side the multiple of the stride nearest the same scale.
The batch finder probes the largest size (:attr:`MultiScale.largest`).

At ``imgsz`` 64 the smallest size is one stride (32 px), where the last stage's maps are 1 x 1:
a micro-batch of one image then leaves BatchNorm one value per channel, which PyTorch refuses
in training. Tiny runs with a 1-image last batch therefore multi-scale from 96 px on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

_STREAM = 0x5CA1E   # a fourth seed word: these draws never share a stream with the data's (seed, epoch, index)


def size_range(imgsz: int, stride: int) -> tuple[int, int]:
    """The smallest and largest multi-scale size: multiples of ``stride`` within [0.5, 1.5] x ``imgsz``.

    Examples:
        >>> size_range(640, 32), size_range(64, 32)
        ((320, 960), (32, 96))
    """
    lo = max(stride, math.ceil(imgsz / 2 / stride) * stride)
    return lo, max(lo, imgsz * 3 // 2 // stride * stride)


def step_size(seed: int, epoch: int, step: int, imgsz: int, stride: int) -> int:
    """The input size of optimizer step ``step`` (counted from 0 in its epoch) of ``epoch``.

    A pure function of its arguments (see the module docstring).
    """
    lo, hi = size_range(imgsz, stride)
    u = np.random.default_rng([seed, epoch, step, _STREAM]).uniform(0.5, 1.5)
    return int(min(hi, max(lo, round(u * imgsz / stride) * stride)))


def resize_batch(images: Tensor, targets: Tensor, size: int, stride: int) -> tuple[Tensor, Tensor]:
    """Images Tensor[B, 3, H, W] with their long side resized to ``size``, and their targets to match.

    The short side becomes ``round(side * size / long / stride) * stride`` (at least one
    stride). Targets are rows ``(image, class, x1, y1, x2, y2)`` in input pixels (pixel edges),
    so each coordinate is multiplied by its axis's factor (new side / old side), exactly what
    ``interpolate(..., align_corners=False)`` does to the pixels. A batch already of that shape
    is returned as it is.
    """
    h, w = images.shape[-2:]
    long = max(h, w)
    nh, nw = (size if side == long else max(stride, round(side * size / long / stride) * stride) for side in (h, w))
    if (nh, nw) == (h, w):
        return images, targets
    images = F.interpolate(images, size=(nh, nw), mode="bilinear", align_corners=False)
    gain = torch.tensor([nw / w, nh / h, nw / w, nh / h], dtype=targets.dtype, device=targets.device)
    return images, torch.cat([targets[:, :2], targets[:, 2:6] * gain, targets[:, 6:]], 1)


@dataclass(frozen=True)
class MultiScale:
    """The run's multi-scale switch: ``scale(images, targets, epoch, step)`` resizes a micro-batch
    to its step's size when ``enabled``, and passes it through otherwise."""

    imgsz: int
    stride: int
    seed: int
    enabled: bool = True

    @property
    def largest(self) -> int:
        """The largest input side a step can have (what the batch finder probes)."""
        return size_range(self.imgsz, self.stride)[1] if self.enabled else self.imgsz

    def size(self, epoch: int, step: int) -> int:
        """Step ``step`` of ``epoch``'s size (``imgsz`` when not enabled)."""
        return step_size(self.seed, epoch, step, self.imgsz, self.stride) if self.enabled else self.imgsz

    def __call__(self, images: Tensor, targets: Tensor, epoch: int, step: int) -> tuple[Tensor, Tensor]:
        if not self.enabled:
            return images, targets
        return resize_batch(images, targets, self.size(epoch, step), self.stride)
