"""Reading and checking image files.

Images inside the data pipeline are numpy arrays `uint8 [H, W, 3]` in OpenCV's
BGR channel order; the Dataset turns them into RGB tensors at the very end.
Grayscale, RGBA and 16-bit files are converted to 8-bit BGR, and the EXIF
orientation tag is applied, so `(H, W)` is always the upright size.
"""

from __future__ import annotations

import os
from pathlib import Path

import cv2
import numpy as np

IMAGE_SUFFIXES = frozenset({".bmp", ".jpeg", ".jpg", ".png", ".tif", ".tiff", ".webp"})

_EXIF_ORIENTATION = 0x0112


class ImageError(ValueError):
    """An image file that cannot be used; the message says why."""


def is_image_file(path: str | os.PathLike) -> bool:
    """True when the file name has one of the supported image suffixes."""
    return Path(path).suffix.lower() in IMAGE_SUFFIXES


def read_image(path: str | os.PathLike) -> np.ndarray:
    """Decode an image file into upright 8-bit BGR.

    Args:
        path: image file.

    Returns:
        uint8 array [H, W, 3], BGR, with the EXIF orientation applied.

    Raises:
        ImageError: the file is missing, unreadable or cannot be decoded.
    """
    try:
        data = np.fromfile(str(path), dtype=np.uint8)
    except OSError as err:
        raise ImageError(f"unreadable file ({err.strerror or err})") from err
    if data.size == 0:
        raise ImageError("empty file")
    image = cv2.imdecode(data, cv2.IMREAD_COLOR)
    if image is None:  # a few valid files (e.g. some rotated TIFFs) trip OpenCV
        image = _read_with_pillow(path)
    return image


def _read_with_pillow(path: str | os.PathLike) -> np.ndarray:
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
        with Image.open(path) as im:  # verify() must come first after open
            fmt = im.format
            im.verify()
        with Image.open(path) as im:
            width, height = im.size
            # Pillow reports TIFF sizes already upright; other formats need the tag
            orientation = im.getexif().get(_EXIF_ORIENTATION, 1) if fmt != "TIFF" else 1
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
