"""Pixels in: decoding files and video frames, colour conversion, the letterbox.

This is the one place that decodes and resizes pixels. Images inside the data pipeline
are numpy arrays `uint8 [H, W, 3]` in OpenCV's BGR channel order; the Dataset turns them
into RGB tensors at the very end. Grayscale, RGBA and 16-bit files are converted to 8-bit
BGR, and the EXIF orientation tag is applied, so `(H, W)` is always the upright size.
Images a caller already holds (numpy RGB, PIL, tensors) become Tensor[3, H, W] uint8 RGB
through `image_tensor`.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import cv2
import numpy as np
import torch
from torch import Tensor

from yolokit.ops.geometry import RatioPad, letterbox_plan

PAD_VALUE = 114
IMAGE_SUFFIXES = frozenset({".bmp", ".jpeg", ".jpg", ".png", ".tif", ".tiff", ".webp"})

_EXIF_ORIENTATION = 0x0112


class ImageError(ValueError):
    """An image file that cannot be used; the message says why."""


def batch_files(paths: list, aug_files: list | None = None, most: int = 8) -> list[str]:
    """The files a loader batch was made from, for a message: its images' ``paths``, then the device
    augmentation's other sources (``aug_files``), each once, the first ``most`` and how many more."""
    names = list(dict.fromkeys([*map(str, paths), *map(str, aug_files or [])]))
    return names[:most] + ([f"... {len(names) - most} more"] if len(names) > most else [])


def is_image_file(path: str | os.PathLike) -> bool:
    """True when the file name has one of the supported image suffixes."""
    return os.path.splitext(os.fspath(path))[1].lower() in IMAGE_SUFFIXES   # no Path: called per file of a scan


def read_bytes(path: str | Path) -> np.ndarray:
    """A file's bytes as uint8 [N]. Raises ImageError (unreadable, empty)."""
    try:
        data = np.fromfile(str(path), dtype=np.uint8)
    except OSError as err:
        raise ImageError(f"unreadable file ({err.strerror or err})") from err
    if data.size == 0:
        raise ImageError("empty file")
    return data


def read_image(path: str | os.PathLike) -> np.ndarray:
    """Decode an image file into upright 8-bit BGR.

    Args:
        path: image file.

    Returns:
        uint8 array [H, W, 3], BGR, with the EXIF orientation applied.

    Raises:
        ImageError: the file is missing, unreadable or cannot be decoded.
    """
    return decode_image(read_bytes(path))


def decode_image(data: np.ndarray) -> np.ndarray:
    """Decode an image file's bytes (uint8 [N]) into upright 8-bit BGR [H, W, 3].

    Raises:
        ImageError: the bytes cannot be decoded.
    """
    image = cv2.imdecode(data, cv2.IMREAD_COLOR)
    if image is None:  # a few valid files (e.g. some rotated TIFFs) trip OpenCV
        image = _read_with_pillow(io.BytesIO(data.tobytes()))
    return image


def _read_with_pillow(path) -> np.ndarray:
    from PIL import Image, ImageOps

    try:
        with Image.open(path) as im:
            rgb = np.asarray(ImageOps.exif_transpose(im).convert("RGB"))
    except Exception as err:  # any decoder failure means the same thing here
        raise ImageError("cannot decode image data") from err
    return np.ascontiguousarray(rgb[:, :, ::-1])


def verify_image(path: str | os.PathLike) -> tuple[int, int]:
    """Check an image file cheaply (header, checksums, end marker) without a full decode.

    Args:
        path: image file.

    Returns:
        The upright size `(height, width)` after the EXIF orientation.

    Raises:
        ImageError: the file is unreadable, corrupt, truncated or an unsupported format.
    """
    from PIL import Image, UnidentifiedImageError  # Pillow ships with torchvision

    path = Path(path)
    if not is_image_file(path):
        raise ImageError(f"unsupported image suffix {path.suffix!r}")
    try:
        with Image.open(path) as im:
            fmt, (width, height) = im.format, im.size
            # JPEG: the EXIF block was read with the header, so one open does (the common case)
            orientation = im.getexif().get(_EXIF_ORIENTATION, 1) if fmt == "JPEG" else 1
            im.verify()
        if fmt not in ("JPEG", "TIFF"):         # after verify() the file must be opened again
            with Image.open(path) as im:
                # Pillow reports TIFF sizes already upright; other formats need the tag
                orientation = im.getexif().get(_EXIF_ORIENTATION, 1)
    except FileNotFoundError as err:
        raise ImageError("file not found") from err
    except PermissionError as err:
        raise ImageError("permission denied") from err
    except UnidentifiedImageError as err:
        raise ImageError("not a recognised image (corrupt or wrong format)") from err
    except Exception as err:  # Pillow signals corrupt data with many exception types
        raise ImageError(f"corrupt image ({type(err).__name__}: {err})") from err
    if fmt == "JPEG":
        with open(path, "rb") as f:
            f.seek(-2, os.SEEK_END)
            if f.read(2) != b"\xff\xd9":
                raise ImageError("truncated JPEG (no end-of-image marker)")
    if width < 2 or height < 2:
        raise ImageError(f"image too small ({width}x{height})")
    if orientation in (5, 6, 7, 8):  # 90 or 270 degree rotations swap the sides
        width, height = height, width
    return height, width


def letterbox(
    image: np.ndarray,
    new_shape: int | tuple[int, int],
    *,
    stride: int = 32,
    auto: bool = False,
    scaleup: bool = True,
    pad_value: int = PAD_VALUE,
) -> tuple[np.ndarray, RatioPad]:
    """Resize keeping the aspect ratio, then pad (centred): ``ops.geometry.letterbox_plan``.

    Args:
        image: [h, w, 3].
        new_shape: output `(H, W)` or one int for a square.
        stride: with `auto`, the output is padded only up to the next multiple of it.
        auto: minimal stride-aligned padding instead of the full `new_shape`.
        scaleup: when False, small images are not enlarged.
        pad_value: grey level of the border.

    Returns:
        `(image, ((ratio_w, ratio_h), (pad_w, pad_h)))`:
        image [H, W, 3] (with `auto`, each side a multiple of `stride`); ratio exact per axis
        (resized size / original size); pad the pixels added on the left and the top, so
        letterboxed = original * ratio + pad.

    Examples:
        >>> out, ratio_pad = letterbox(np.zeros((480, 640, 3), np.uint8), 320)
        >>> out.shape, ratio_pad
        ((320, 320, 3), ((0.5, 0.5), (0.0, 40.0)))
    """
    plan = letterbox_plan(image.shape[:2], new_shape, stride=stride, auto=auto, scaleup=scaleup)
    (nh, nw), (left, top, right, bottom) = plan.size, plan.pad
    if plan.size != image.shape[:2]:
        image = cv2.resize(image, (nw, nh), interpolation=cv2.INTER_LINEAR)
    if plan.shape != plan.size:
        image = cv2.copyMakeBorder(image, top, bottom, left, right, cv2.BORDER_CONSTANT,
                                   value=(pad_value,) * 3)
    return image, plan.ratio_pad


def bgr_to_tensor(bgr: np.ndarray) -> Tensor:
    """An HxWx3 uint8 BGR array (OpenCV's order) as Tensor[3, H, W] uint8 RGB."""
    return torch.from_numpy(np.ascontiguousarray(bgr[..., ::-1].transpose(2, 0, 1)))


def image_tensor(image: Any) -> Tensor:
    """An image held in memory as Tensor[3, H, W] uint8 RGB.

    Args:
        image: a Tensor[3, H, W] (uint8, or float in [0, 1]), a numpy HxWx3 / HxWx4
            array in RGB(A) order or HxW grayscale (any strides), or a PIL image.

    Raises:
        TypeError: a path (files are read by ``read_image``, sources by ``yolokit.predict``).
        ValueError: an array or tensor of another shape.
    """
    if isinstance(image, (str, os.PathLike)):
        raise TypeError(f"{image}: a path, not an image in memory (files, folders and videos are read by "
                        "yolokit.predict(model, source))")
    if isinstance(image, Tensor):
        if image.ndim != 3 or image.shape[0] != 3:
            raise ValueError(f"an image tensor must be Tensor[3, H, W], got shape {tuple(image.shape)}")
        image = image.detach().cpu()
        return (image.clamp(0, 1) * 255).round().to(torch.uint8) if image.is_floating_point() else image
    if hasattr(image, "convert") and hasattr(image, "size"):  # PIL.Image, duck-typed
        image = np.asarray(image.convert("RGB"))
    array = np.asarray(image)
    if array.ndim == 2:
        array = np.repeat(array[..., None], 3, axis=2)
    if array.ndim != 3 or array.shape[2] not in (3, 4):
        raise ValueError(f"a numpy image must be HxWx3 RGB (or HxW), got shape {array.shape}")
    return torch.from_numpy(np.ascontiguousarray(array[..., :3].transpose(2, 0, 1)))


class VideoFrame(NamedTuple):
    """One decoded frame: ``index`` in the video, ``bgr`` HxWx3 uint8, the video's ``fps``
    (30 when OpenCV does not say) and frame ``count`` (None when unknown, as for cameras)."""

    index: int
    bgr: np.ndarray
    fps: float
    count: int | None


def read_video(target: str | os.PathLike | int, *, vid_stride: int = 1) -> Iterator[VideoFrame]:
    """Decodes a video file, camera index or stream URL through OpenCV, every ``vid_stride``-th frame.

    Raises:
        ValueError: OpenCV cannot open it (the message names it).
    """
    capture = cv2.VideoCapture(target if isinstance(target, int) else str(target))
    if not capture.isOpened():
        capture.release()
        what = f"camera {target}" if isinstance(target, int) else f"video or stream {target}"
        raise ValueError(f"OpenCV cannot open {what}")
    try:
        fps = capture.get(cv2.CAP_PROP_FPS)
        fps = fps if fps and 0 < fps < 1000 else 30.0
        count = int(capture.get(cv2.CAP_PROP_FRAME_COUNT)) if not isinstance(target, int) else 0
        index = 0
        while True:
            ok, bgr = capture.read()
            if not ok:
                break
            if index % vid_stride == 0:
                yield VideoFrame(index, bgr, fps, count if count > 0 else None)
            index += 1
    finally:
        capture.release()
