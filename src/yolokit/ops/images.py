"""Images already in memory as tensors: conversion and letterbox, in torch alone.

Files are decoded by ``yolokit.data.images``; files, folders, globs and videos are read
and batched by ``yolokit.predict``. What comes here is an image the caller holds: a
Tensor[3, H, W], a numpy HxWx3 (or HxW) array, or a PIL image. All resizing and padding
happens on tensors, on whatever device they live.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from yolokit.ops.geometry import RatioPad, letterbox_plan


def to_image_tensor(image: Any) -> Tensor:
    """One in-memory image as Tensor[3, H, W] (uint8 RGB, or float in [0, 1] if given as float).

    Accepts a Tensor[3, H, W], a numpy HxWx3 / HxWx4 array in RGB(A) order (or HxW
    grayscale), or a PIL image (converted to RGB).

    Raises:
        TypeError: a path (read those with ``yolokit.predict``).
        ValueError: an array or tensor of another shape.
    """
    if isinstance(image, (str, Path)):
        raise TypeError(f"{image}: a path; files, folders, globs and videos are read by yolokit.predict "
                        "(predict(model, source) or predict_iter), Detector.predict takes images in memory")
    if isinstance(image, Tensor):
        if image.ndim != 3 or image.shape[0] != 3:
            raise ValueError(f"an image tensor must be Tensor[3, H, W], got shape {tuple(image.shape)}")
        return image
    if hasattr(image, "convert") and hasattr(image, "size"):  # PIL.Image, duck-typed
        from torchvision.transforms.v2.functional import pil_to_tensor

        return pil_to_tensor(image.convert("RGB"))
    array = torch.as_tensor(image.copy() if hasattr(image, "strides") else image)  # numpy: any strides
    if array.ndim == 2:
        array = array[..., None].expand(-1, -1, 3)
    if array.ndim != 3 or array.shape[2] not in (3, 4):
        raise ValueError(f"a numpy image must be HxWx3 RGB (or HxW), got shape {tuple(array.shape)}")
    return array[..., :3].permute(2, 0, 1).contiguous()


def load_images(images: Any) -> list[Tensor]:
    """In-memory images as a list of Tensor[3, H, W] (see ``to_image_tensor``).

    Args:
        images: one image, a list of images, or a Tensor[B, 3, H, W] batch.
    """
    if isinstance(images, Tensor) and images.ndim == 4:
        return list(images)
    if isinstance(images, (list, tuple)):
        return [to_image_tensor(im) for im in images]
    return [to_image_tensor(images)]


def letterbox(
    image: Tensor,
    new_shape: int | tuple[int, int],
    *,
    stride: int = 32,
    auto: bool = False,
    scaleup: bool = True,
    pad_value: float = 114 / 255,
) -> tuple[Tensor, RatioPad]:
    """Resizes keeping the aspect ratio (bilinear), then pads centred: ``ops.geometry.letterbox_plan``.

    Args:
        image: Tensor[3, H, W], uint8 or float in [0, 1].
        new_shape: (height, width) to fit into, or one int for a square.
        stride: with ``auto``, pad only up to the next multiple of this.
        auto: pad to the smallest stride multiple instead of all of ``new_shape``.
        scaleup: allow enlarging small images.
        pad_value: fill of the padding, in [0, 1].

    Returns:
        ``(out, ((ratio_w, ratio_h), (pad_w, pad_h)))``: out is Tensor[3, H', W'] float in
        [0, 1]; the original maps to ``out`` by scaling with the ratios and shifting right
        by pad_w and down by pad_h (the same result as ``yolokit.data.transforms.letterbox``).
    """
    img = image.float() / 255 if not image.is_floating_point() else image.float()
    plan = letterbox_plan(img.shape[-2:], new_shape, stride=stride, auto=auto, scaleup=scaleup)
    if plan.size != tuple(img.shape[-2:]):
        img = F.interpolate(img[None], size=plan.size, mode="bilinear", align_corners=False)[0]
    left, top, right, bottom = plan.pad
    img = F.pad(img, (left, right, top, bottom), value=pad_value)
    return img, plan.ratio_pad


def letterbox_batch(images: Sequence[Tensor], imgsz: int, stride: int) -> tuple[Tensor, list[RatioPad]]:
    """Letterboxes images into one batch Tensor[B, 3, S, S] float in [0, 1].

    ``imgsz`` is rounded up to a multiple of ``stride``. When every image has the same
    shape the batch is the smallest stride-aligned rectangle around them (less padding,
    faster), otherwise the square.

    Returns:
        ``(batch, ratio_pads)``, one ``((ratio_w, ratio_h), (pad_w, pad_h))`` per image.
    """
    size = math.ceil(imgsz / stride) * stride
    same = len({tuple(im.shape[-2:]) for im in images}) == 1
    boxed = [letterbox(im, (size, size), stride=stride, auto=same) for im in images]
    return torch.stack([b for b, _ in boxed]), [rp for _, rp in boxed]
