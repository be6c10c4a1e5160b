"""A COCO instances json's annotations as label rows: boxes, and for segmentation each object's outline.

An annotation's ``segmentation`` is a list of polygons (flat ``[x1, y1, x2, y2, ...]`` in pixels): an object
seen in several parts (occluded, cut by another) has several. The pipeline draws one polygon per row, so the
parts are joined into one outline (:func:`join_parts`): each part is walked around once, and the next part is
reached and left by the shortest bridge between the two (the bridge has no width and paints only its line,
as the reference's joined outlines do). A run-length (RLE) ``segmentation`` of a non-crowd object gives a box
row; crowd annotations are left out, as for detection.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from yolokit.data.sources.images import ImageError, verify_image
from yolokit.data.sources.labels import BACKGROUND, EXCLUDED, FIXED, Problem, clean_pixel_rows


def annotation_polygon(annotation: dict[str, Any]) -> np.ndarray | None:
    """An annotation's outline: float64 [K, 2] pixels (its parts joined), or None (RLE, or no part of three
    points or more)."""
    parts = annotation.get("segmentation")
    if not isinstance(parts, list):
        return None
    parts = [np.asarray(p, np.float64).reshape(-1, 2) for p in parts
             if isinstance(p, (list, tuple)) and len(p) >= 6 and len(p) % 2 == 0]
    return join_parts(parts) if parts else None


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
                     polygons: list[np.ndarray | None], unknown: int):
    """One image of the json: its shape, its rows (class, x1, y1, x2, y2) cleaned as a YOLO label's are, each
    kept row's polygon (None for a box row), and what was fixed or why it was left out."""
    try:
        shape = verify_image(path)
    except ImageError as err:
        return None, None, None, Problem(path, str(err), EXCLUDED)
    fixes = [f"{unknown} annotation(s) with unknown category_id dropped"] if unknown else []
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
