"""Inference-side image handling: read, convert and letterbox images as tensors.

The training pipeline (``yolokit.data``) has its own numpy/OpenCV transforms; these are
the pieces ``Detector.predict`` needs to accept paths, folders, numpy arrays, PIL images
and tensors. Files are decoded with OpenCV (torchvision's decoders are deprecated); all
resizing and padding happens on tensors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

IMAGE_SUFFIXES = (".bmp", ".jpeg", ".jpg", ".png", ".tif", ".tiff", ".webp")
RatioPad = tuple[tuple[float, float], tuple[float, float]]


def image_files(source: str | Path) -> list[Path]:
    """The image files a path names: itself, or a folder's images sorted by name.

    Raises:
        FileNotFoundError: the path does not exist, or a folder holds no image.
    """
    path = Path(source)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise FileNotFoundError(f"no images ({', '.join(IMAGE_SUFFIXES)}) in folder {path}")
        return files
    if not path.is_file():
        raise FileNotFoundError(f"image source not found: {path}")
    return [path]


def read_image(path: str | Path) -> Tensor:
    """Reads an image file as Tensor[3, H, W] uint8 RGB, EXIF orientation applied.

    Grayscale, RGBA and 16-bit files are converted to 8-bit RGB.

    Raises:
        ValueError: the file cannot be decoded (the message names it).
    """
    data = np.fromfile(str(path), dtype=np.uint8)
    image = cv2.imdecode(data, cv2.IMREAD_COLOR) if data.size else None
    if image is None:
        raise ValueError(f"cannot decode image {path}")
    return torch.from_numpy(np.ascontiguousarray(image[..., ::-1].transpose(2, 0, 1)))


def to_image_tensor(image: Any) -> Tensor:
    """One image as Tensor[3, H, W] (uint8 RGB, or float in [0, 1] if given as float).

    Accepts a numpy HWC array (uint8 RGB, or HW grayscale), a PIL image (converted to
    RGB), or a Tensor[3, H, W].
    """
    if isinstance(image, Tensor):
        if image.ndim != 3 or image.shape[0] != 3:
            raise ValueError(f"an image tensor must be Tensor[3, H, W], got shape {tuple(image.shape)}")
        return image
    if hasattr(image, "convert") and hasattr(image, "size"):  # PIL.Image, duck-typed
        image = image.convert("RGB")
    array = np.asarray(image)
    array = torch.from_numpy(array if array.flags.writeable else array.copy())
    if array.ndim == 2:
        array = array[..., None].expand(-1, -1, 3)
    if array.ndim != 3 or array.shape[2] not in (3, 4):
        raise ValueError(f"a numpy image must be HxWx3 RGB (or HxW), got shape {tuple(array.shape)}")
    return array[..., :3].permute(2, 0, 1).contiguous()


def load_images(sources: Any) -> tuple[list[Tensor], list[str]]:
    """Every image named by ``sources`` as Tensor[3, H, W], with a name for each.

    Args:
        sources: a path (file or folder), an image (numpy, PIL, Tensor[3, H, W]), a
            Tensor[B, 3, H, W] batch, or a list of any of these.

    Returns:
        ``(images, names)``: file paths for files, ``"image{i}"`` otherwise.
    """
    if isinstance(sources, Tensor) and sources.ndim == 4:
        sources = list(sources)
    elif isinstance(sources, (str, Path)) or not isinstance(sources, Iterable) or hasattr(sources, "shape"):
        sources = [sources]
    images, names = [], []
    for source in sources:
        if isinstance(source, (str, Path)):
            for path in image_files(source):
                images.append(read_image(path))
                names.append(str(path))
        else:
            images.append(to_image_tensor(source))
            names.append(f"image{len(names)}")
    return images, names


def letterbox(
    image: Tensor,
    new_shape: tuple[int, int],
    *,
    stride: int = 32,
    auto: bool = False,
    scaleup: bool = True,
    pad_value: float = 114 / 255,
) -> tuple[Tensor, RatioPad]:
    """Resizes keeping the aspect ratio, then pads to ``new_shape``.

    Args:
        image: Tensor[3, H, W], uint8 or float in [0, 1].
        new_shape: (height, width) to fit into.
        stride: with ``auto``, pad only up to the next multiple of this.
        auto: pad to the smallest stride multiple instead of all of ``new_shape``.
        scaleup: allow enlarging small images.
        pad_value: fill of the padding, in [0, 1].

    Returns:
        ``(out, ((ratio_w, ratio_h), (pad_w, pad_h)))``: out is Tensor[3, H', W'] float in
        [0, 1]; the original maps to ``out`` by scaling with the ratios and shifting right
        by pad_w and down by pad_h.
    """
    img = image.float() / 255 if not image.is_floating_point() else image.float()
    h, w = img.shape[-2:]
    r = min(new_shape[0] / h, new_shape[1] / w)
    if not scaleup:
        r = min(r, 1.0)
    nh, nw = max(1, round(h * r)), max(1, round(w * r))
    if (nh, nw) != (h, w):
        img = F.interpolate(img[None], size=(nh, nw), mode="bilinear", align_corners=False)[0]
    if auto:
        th, tw = math.ceil(nh / stride) * stride, math.ceil(nw / stride) * stride
    else:
        th, tw = new_shape
    top, left = (th - nh) // 2, (tw - nw) // 2
    img = F.pad(img, (left, tw - nw - left, top, th - nh - top), value=pad_value)
    return img, ((nw / w, nh / h), (float(left), float(top)))
