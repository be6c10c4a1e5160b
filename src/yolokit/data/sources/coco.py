"""A COCO instances json's annotations as label rows: boxes, and for segmentation each object's outline.

An annotation's ``segmentation`` is a list of polygons (flat ``[x1, y1, x2, y2, ...]`` in pixels): an object
seen in several parts (occluded, cut by another) has several. The pipeline draws one polygon per row, so the
parts are joined into one outline (:func:`join_parts`): each part is walked around once, and the next part is
reached and left by the shortest bridge between the two (the bridge has no width and paints only its line,
as the reference's joined outlines do). A run-length (RLE) ``segmentation`` of a non-crowd object is decoded
and its outer contours are its parts; crowd annotations are left out, as for detection.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from yolokit.data.sources.images import ImageError, verify_image
from yolokit.data.sources.labels import BACKGROUND, EXCLUDED, FIXED, Problem, clean_pixel_rows


def annotation_polygon(annotation: dict[str, Any], image_hw: tuple[int, int] = (0, 0)
                       ) -> tuple[np.ndarray | None, str | None]:
    """An annotation's outline: float64 [K, 2] pixels (its parts joined), or None (no part of three points or
    more: a box row); and what was wrong with it, or None.

    A run-length ``segmentation`` (``{"size": [h, w], "counts": ...}``, compressed or not) is decoded and its
    outer contours are the parts; one whose size is not the image's (``image_hw``, the json's height and
    width) gives a box row, and says so.
    """
    parts = annotation.get("segmentation")
    if isinstance(parts, dict) and "counts" in parts:
        return _rle_outline(parts, annotation.get("id"), image_hw)
    if not isinstance(parts, list):
        return None, None
    parts = [np.asarray(p, np.float64).reshape(-1, 2) for p in parts
             if isinstance(p, (list, tuple)) and len(p) >= 6 and len(p) % 2 == 0]
    return (join_parts(parts) if parts else None), None


def _rle_outline(rle: dict[str, Any], ann_id: Any, image_hw: tuple[int, int]) -> tuple[np.ndarray | None, str | None]:
    import cv2
    from pycocotools import mask as mask_utils  # here: only a json with RLE objects needs it

    size = [int(v) for v in rle.get("size", [0, 0])]
    if all(image_hw) and tuple(size) != tuple(int(v) for v in image_hw):
        return None, (f"annotation {ann_id}: RLE size {size[1]}x{size[0]} differs from the image's "
                      f"{image_hw[1]}x{image_hw[0]}, kept as a box row (no mask)")
    try:
        encoded = mask_utils.frPyObjects(rle, *size) if isinstance(rle["counts"], list) else rle
        with warnings.catch_warnings():   # pycocotools' decode under NumPy 2: a DeprecationWarning per call
            warnings.simplefilter("ignore", DeprecationWarning)
            mask = np.ascontiguousarray(mask_utils.decode(encoded), np.uint8)
    except Exception as exc:   # pycocotools' own errors on bad counts
        return None, f"annotation {ann_id}: RLE cannot be decoded ({type(exc).__name__}), kept as a box row"
    contours, _ = cv2.findContours(mask, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_NONE)
    parts = [c.reshape(-1, 2).astype(np.float64) for c in contours if len(c) >= 3]
    return (join_parts(parts) if parts else None), None


def join_parts(parts: Sequence[np.ndarray]) -> np.ndarray:
    """Polygons (float [K_i, 2]) as one outline: part 0 walked from its first point; where it comes nearest
    to part 1 the outline crosses over, walks part 1 (and, from there, the parts after it) all the way round,
    crosses back and goes on along part 0 to its start."""
    parts = [np.asarray(p, np.float64).reshape(-1, 2) for p in parts]
    return _walk(parts, 0, 0)[:-1] if len(parts) > 1 else parts[0]


def _walk(parts: list[np.ndarray], i: int, start: int) -> np.ndarray:
    """Part i from its point ``start`` round to it again (closed: the first point repeated at the end), with
    parts i + 1, ... walked in the middle, entered at their points nearest part i."""
    p = np.roll(parts[i], -start, axis=0)
    if i == len(parts) - 1:
        return np.concatenate([p, p[:1]])
    distance = ((p[:, None, :] - parts[i + 1][None, :, :]) ** 2).sum(-1)
    a, b = np.unravel_index(int(distance.argmin()), distance.shape)
    return np.concatenate([p[:a + 1], _walk(parts, i + 1, int(b)), p[a:], p[:1]])


def check_coco_image(path: str, json_hw: tuple[int, int], anns: list[list[float]],
                     polygons: list[np.ndarray | None], unknown: int, notes: Sequence[str] = ()):
    """One image of the json: its shape, its rows (class, x1, y1, x2, y2) cleaned as a YOLO label's are, each
    kept row's polygon (None for a box row), and what was fixed or why it was left out (``notes``: what
    ``annotation_polygon`` said of its annotations)."""
    try:
        shape = verify_image(path)
    except ImageError as err:
        return None, None, None, Problem(path, str(err), EXCLUDED)
    fixes = ([f"{unknown} annotation(s) with unknown category_id dropped"] if unknown else []) + list(notes)
    arr = np.array(anns, np.float64).reshape(-1, 5)
    arr[:, 3:5] += arr[:, 1:3]  # xywh -> xyxy
    scale = np.ones(2)
    if json_hw and tuple(json_hw) != tuple(shape) and all(json_hw):
        fixes.append(f"json size {json_hw[1]}x{json_hw[0]} differs from the file's "
                     f"{shape[1]}x{shape[0]}; boxes scaled")
        scale = np.array([shape[1] / json_hw[1], shape[0] / json_hw[0]])
        arr[:, [1, 3]] *= scale[0]
        arr[:, [2, 4]] *= scale[1]
    labels, kept, more = clean_pixel_rows(arr, shape)
    fixes += more
    h, w = shape
    outlines = [None if polygons[k] is None else (polygons[k] * scale).clip(0, [w, h]).astype(np.float32)
                for k in kept]
    if fixes:
        return shape, labels, outlines, Problem(path, "; ".join(fixes), FIXED)
    if len(labels) == 0:
        return shape, labels, outlines, Problem(path, "no annotations", BACKGROUND)
    return shape, labels, outlines, None
