"""Letterbox geometry: numbers only, no pixels.

Letterboxing fits an image into a shape keeping its aspect ratio: resize by one ratio
(rounded to whole pixels, so the exact ratio differs a little per axis), then pad centred.
``letterbox_plan`` computes the sizes and the padding once; ``yolokit.data.sources.images.letterbox``
applies it to pixels (OpenCV) and returns the image with its ``ratio_pad``
``((ratio_w, ratio_h), (pad_w, pad_h))``: a point of the original maps to
``original * ratio + pad``, and ``unletterbox_boxes`` maps boxes back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from torch import Tensor

from yolokit.ops.boxes import clip_boxes

RatioPad = tuple[tuple[float, float], tuple[float, float]]


class LetterboxPlan(NamedTuple):
    """How an image of some size goes into a letterbox.

    Attributes:
        size: (height, width) the image is resized to, whole pixels, at least 1.
        shape: (height, width) of the output, padding included.
        pad: (left, top, right, bottom) padding in pixels.
        ratio: (ratio_w, ratio_h), resized size / original size per axis (exact).
    """

    size: tuple[int, int]
    shape: tuple[int, int]
    pad: tuple[int, int, int, int]
    ratio: tuple[float, float]

    @property
    def ratio_pad(self) -> RatioPad:
        """``((ratio_w, ratio_h), (pad_w, pad_h))``: letterboxed = original * ratio + pad."""
        return self.ratio, (float(self.pad[0]), float(self.pad[1]))


def letterbox_plan(
    shape: Sequence[int],
    new_shape: int | Sequence[int],
    *,
    stride: int = 32,
    auto: bool = False,
    scaleup: bool = True,
) -> LetterboxPlan:
    """Sizes and padding that fit an image of ``shape`` into ``new_shape``, aspect kept.

    One ratio r = min(H / h, W / w) (at most 1 without ``scaleup``) scales both sides, each
    rounded to whole pixels (Python's ``round``); the padding is split evenly, the odd pixel
    going to the right and the bottom.

    Args:
        shape: (h, w) of the image.
        new_shape: (H, W) to fit into, or one int for a square.
        stride: with ``auto``, the output is padded only up to the next multiple of it.
        auto: minimal stride-aligned padding instead of all of ``new_shape``.
        scaleup: when False, small images are not enlarged.

    Returns:
        ``LetterboxPlan``.

    Examples:
        >>> letterbox_plan((480, 640), 320)
        LetterboxPlan(size=(240, 320), shape=(320, 320), pad=(0, 40, 0, 40), ratio=(0.5, 0.5))
        >>> letterbox_plan((333, 500), (256, 320), auto=True).shape
        (224, 320)
    """
    if isinstance(new_shape, int):
        new_shape = (new_shape, new_shape)
    h, w = int(shape[0]), int(shape[1])
    r = min(new_shape[0] / h, new_shape[1] / w)
    if not scaleup:
        r = min(r, 1.0)
    nh, nw = max(1, round(h * r)), max(1, round(w * r))
    if auto:
        out_h, out_w = math.ceil(nh / stride) * stride, math.ceil(nw / stride) * stride
    else:
        out_h, out_w = int(new_shape[0]), int(new_shape[1])
    left, top = (out_w - nw) // 2, (out_h - nh) // 2
    return LetterboxPlan((nh, nw), (out_h, out_w), (left, top, out_w - nw - left, out_h - nh - top),
                         (nw / w, nh / h))


def unletterbox_boxes(boxes: Tensor, ratio_pad: RatioPad, orig_shape: Sequence[int]) -> Tensor:
    """Maps ``xyxy`` boxes from a letterboxed image back to the original image.

    Args:
        boxes: Tensor[N, 4] xyxy in letterboxed pixels.
        ratio_pad: ``((ratio_w, ratio_h), (pad_w, pad_h))``: the original was resized by
            the ratios, then padded by ``pad_w`` on the left and ``pad_h`` on the top.
        orig_shape: (height, width) of the original image.

    Returns:
        Tensor[N, 4] xyxy in original pixels, clipped to the image.
    """
    (rw, rh), (pw, ph) = ratio_pad
    offset = boxes.new_tensor([pw, ph, pw, ph])
    scale = boxes.new_tensor([rw, rh, rw, rh])
    return clip_boxes((boxes - offset) / scale, orig_shape)
