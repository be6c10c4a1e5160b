"""Polygons of instance masks through the data pipeline: resampled before a warp, rasterized to masks after.

A polygon is float32 [K, 2] ``(x, y)`` points in pixels of its image. Before a geometric warp each polygon
is resampled to ``POINTS`` points along its closed outline (the original points kept among them), so that a
warped outline keeps its shape and can be clipped to the image. Masks are drawn at the image's size (points
truncated to whole pixels, as OpenCV's polygon fill takes them) and shrunk by the mask ratio with OpenCV's
bilinear resize: the reference's rasterization, step for step. With ``overlap`` (the default) an image's
masks are one index map, larger objects drawn first, so a smaller object lies over a larger one.
"""

from __future__ import annotations

from collections.abc import Sequence

import cv2
import numpy as np

POINTS = 1000   # points of each polygon before a warp


def resample_polygon(points: np.ndarray, n: int = POINTS) -> np.ndarray:
    """``points`` (float [K, 2]) as ``n`` points along its closed outline, linearly interpolated.

    With fewer than ``n`` points, the outline's own K points and its closing point (the first again) are
    kept, and ``n - K - 1`` evenly spaced positions along the outline added among them; with more, ``n``
    evenly spaced positions. ``n`` points are returned as they are.

    Returns:
        float32 [n, 2].
    """
    points = np.asarray(points, np.float64).reshape(-1, 2)
    if len(points) == n:
        return points.astype(np.float32)
    closed = np.concatenate([points, points[:1]])
    at = np.arange(len(closed))
    if len(closed) <= n:
        new = np.linspace(0, len(closed) - 1, n - len(closed))
        where = np.insert(new, np.searchsorted(new, at), at)
    else:
        where = np.linspace(0, len(closed) - 1, n)
    return np.stack([np.interp(where, at, closed[:, 0]), np.interp(where, at, closed[:, 1])], 1).astype(np.float32)


def polygon_mask(points: np.ndarray, shape: tuple[int, int], ratio: int = 1) -> np.ndarray:
    """The mask of one polygon: uint8 [H // ratio, W // ratio] of 0 and 1.

    Drawn at ``shape`` (H, W) with the points truncated to whole pixels, then resized (bilinear) by ``ratio``.
    """
    h, w = int(shape[0]), int(shape[1])
    mask = np.zeros((h, w), np.uint8)
    cv2.fillPoly(mask, np.asarray(points, np.float64).astype(np.int32).reshape(1, -1, 2), color=1)
    return cv2.resize(mask, (w // ratio, h // ratio))


def polygon_masks(polygons: Sequence[np.ndarray], shape: tuple[int, int], ratio: int = 1) -> np.ndarray:
    """One mask per polygon: uint8 [N, H // ratio, W // ratio] (``overlap=False``'s masks)."""
    h, w = int(shape[0]) // ratio, int(shape[1]) // ratio
    if not len(polygons):
        return np.zeros((0, h, w), np.uint8)
    return np.stack([polygon_mask(p, shape, ratio) for p in polygons])


def overlap_mask(polygons: Sequence[np.ndarray], shape: tuple[int, int], ratio: int = 1
                 ) -> tuple[np.ndarray, np.ndarray]:
    """An image's masks as one index map, and the order of its objects in it.

    Each polygon's mask is drawn (:func:`polygon_mask`), the masks are ordered by area at the mask's size,
    largest first (NumPy's default argsort of the negated unsigned areas: an object without a pixel at the
    mask's size comes before all others), and the k-th of them in that order takes
    the value k + 1 wherever it is set, over the values before it: a smaller object lies on a larger one.

    Returns:
        ``(index_map, order)``: uint8 [H // ratio, W // ratio] (int32 beyond 255 objects), and int64 [N] the
        objects in map order (``order[k]`` is the object of value k + 1). An image's rows must be put in that
        order too, so that row k is value k + 1.
    """
    h, w = int(shape[0]) // ratio, int(shape[1]) // ratio
    index = np.zeros((h, w), np.int32 if len(polygons) > 255 else np.uint8)
    if not len(polygons):
        return index, np.zeros(0, np.int64)
    masks = polygon_masks(polygons, shape, ratio).astype(index.dtype)
    areas = masks.reshape(len(masks), -1).sum(1, dtype=np.uint64)
    order = np.argsort(-areas)       # unsigned: an object of no pixels wraps to 0 and comes first, as the reference's
    for value, k in enumerate(order, 1):
        np.maximum(index, masks[k] * value, out=index)
    return index, order.astype(np.int64)
