"""Polygons of instance masks through the data pipeline: resampled before a warp, rasterized to masks after.

A polygon is float32 [K, 2] ``(x, y)`` points in pixels of its image. Before a geometric warp each polygon
is resampled to ``POINTS`` points along its closed outline (the original points kept among them), so that a
warped outline keeps its shape and can be clipped to the image. Masks are drawn at the image's size (points
truncated to whole pixels, as OpenCV's polygon fill takes them) and shrunk by the mask ratio with OpenCV's
bilinear resize: the reference's rasterization, step for step. With ``overlap`` (the default) an image's
masks are one index map, larger objects drawn first, so a smaller object lies over a larger one.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from functools import lru_cache
from typing import NamedTuple

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
    return resample_polygons(points[None], n)[0]


def resample_polygons(points: np.ndarray, n: int = POINTS) -> np.ndarray:
    """:func:`resample_polygon` of polygons of one point count at once: float [G, K, 2] to float32 [G, n, 2]
    (``np.interp``'s numbers: each new point is ``(p[j + 1] - p[j]) * (t - j) + p[j]`` in float64)."""
    points = np.asarray(points, np.float64)
    return points.astype(np.float32) if points.shape[1] == n else _resample_all(list(points), n)


@lru_cache(maxsize=256)
def _resample_table(closed: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where :func:`resample_polygons`' ``n`` points lie on an outline of ``closed`` points: each one's segment
    (its first point's index), its fraction along it (float64 [n, 2]: for x and y, so that the product with
    the points [n, 2] needs no broadcast of a last axis of 2, which NumPy does far slower), and which of them
    are the outline's last point."""
    at = np.arange(closed)
    if closed <= n:
        new = np.linspace(0, closed - 1, n - closed)
        where = np.insert(new, np.searchsorted(new, at), at)
    else:
        where = np.linspace(0, closed - 1, n)
    low = np.minimum(np.floor(where).astype(np.int64), closed - 2)
    tables = low, np.repeat(where - low, 2).reshape(n, 2), np.flatnonzero(where >= closed - 1)
    for table in tables:                                                # cached: shared by every later call
        table.setflags(write=False)
    return tables


def polygon_mask(points: np.ndarray, shape: tuple[int, int], ratio: int = 1) -> np.ndarray:
    """The mask of one polygon: uint8 [H // ratio, W // ratio] of 0 and 1.

    Drawn at ``shape`` (H, W) with the points truncated to whole pixels, then resized (bilinear) by ``ratio``.
    """
    h, w = int(shape[0]), int(shape[1])
    mask = np.zeros((h, w), np.uint8)
    cv2.fillPoly(mask, np.asarray(points, np.float64).astype(np.int32).reshape(1, -1, 2), color=1)
    return cv2.resize(mask, (w // ratio, h // ratio))


class MaskCrop(NamedTuple):
    """A polygon's mask where it can have pixels: ``mask`` (uint8 [h, w] of 0 and 1) at rows ``top`` and
    columns ``left`` of the whole mask (at the mask's size); an empty ``mask`` when the polygon has none."""

    top: int
    left: int
    mask: np.ndarray


def polygon_crop(points: np.ndarray, shape: tuple[int, int], ratio: int = 1) -> MaskCrop:
    """:func:`polygon_mask`'s pixels inside the polygon's box only, the same values.

    The fill is drawn in the polygon's points' box (clipped to the image, widened to whole blocks of
    ``ratio`` pixels) and resized alone: a pixel of an integer downscale is read from its own block
    only, and a fill's pixels from its points' box only. An image whose sides are not multiples of
    ``ratio`` (a resize that is not an integer downscale) is drawn whole."""
    h, w, r = int(shape[0]), int(shape[1]), int(ratio)
    if h % r or w % r:
        return MaskCrop(0, 0, polygon_mask(points, shape, ratio))
    pts = (points if isinstance(points, np.ndarray) and points.dtype == np.int32 else
           np.asarray(points, np.float64).astype(np.int32)).reshape(-1, 2)
    x_lo, y_lo, dx, dy = cv2.boundingRect(pts)                      # the points' extent, in one call
    x_hi, y_hi = x_lo + dx - 1, y_lo + dy - 1
    if x_hi < 0 or y_hi < 0 or x_lo >= w or y_lo >= h:
        return MaskCrop(0, 0, np.zeros((0, 0), np.uint8))
    return _fill(pts, max(x_lo, 0) // r * r, max(y_lo, 0) // r * r, (min(x_hi, w - 1) // r + 1) * r,
                 (min(y_hi, h - 1) // r + 1) * r, r)


def _fill(points: np.ndarray, x0: int, y0: int, x1: int, y1: int, r: int) -> MaskCrop:
    """The fill of ``points`` (int32 [K, 2]) in columns x0:x1 and rows y0:y1 of the image, shrunk by ``r``."""
    crop = np.zeros((y1 - y0, x1 - x0), np.uint8)
    cv2.fillPoly(crop, points.reshape(1, -1, 2), color=1, offset=(-x0, -y0))
    return MaskCrop(y0 // r, x0 // r, crop if r == 1 else cv2.resize(crop, ((x1 - x0) // r, (y1 - y0) // r)))


def polygon_masks(polygons: Sequence[np.ndarray], shape: tuple[int, int], ratio: int = 1) -> np.ndarray:
    """One mask per polygon: uint8 [N, H // ratio, W // ratio] (``overlap=False``'s masks)."""
    h, w = int(shape[0]) // ratio, int(shape[1]) // ratio
    masks = np.zeros((len(polygons), h, w), np.uint8)
    for k, p in enumerate(polygons):
        _paste(masks[k], polygon_crop(p, shape, ratio))
    return masks


def _paste(whole: np.ndarray, crop: MaskCrop) -> None:
    ch, cw = crop.mask.shape
    whole[crop.top:crop.top + ch, crop.left:crop.left + cw] = crop.mask


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
    return overlap_of_crops([polygon_crop(p, shape, ratio) for p in polygons],
                            (int(shape[0]) // ratio, int(shape[1]) // ratio))


def overlap_of_crops(crops: Sequence[MaskCrop], shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """:func:`overlap_mask` of masks given as crops (:func:`polygon_crop`)."""
    index = np.zeros(shape, np.int32 if len(crops) > 255 else np.uint8)
    if not len(crops):
        return index, np.zeros(0, np.int64)
    areas = np.array([cv2.countNonZero(c.mask) if c.mask.size else 0 for c in crops], np.uint64)   # 0 and 1
    order = np.argsort(-areas)       # unsigned: an object of no pixels wraps to 0 and comes first, as the reference's
    for value, k in enumerate(order, 1):         # each value above those before it: it covers them
        top, left, mask = crops[k]
        np.copyto(index[top:top + mask.shape[0], left:left + mask.shape[1]], value, where=mask.view(bool))
    return index, order.astype(np.int64)


def _by_coordinate(points: np.ndarray) -> np.ndarray:
    """Points [..., K, 2] as a contiguous [2, ..., K]: x, then y."""
    return np.ascontiguousarray(np.moveaxis(points, -1, 0))


def _extent(coords: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The lowest and highest ``(x, y)`` of points by coordinate (:func:`_by_coordinate`): two [..., 2] arrays
    (reduced over a contiguous copy: NumPy reduces an axis with a last axis of 2 after it far slower)."""
    back = (*range(1, coords.ndim - 1), 0)
    return coords.min(-1).transpose(back), coords.max(-1).transpose(back)


def polygon_boxes(polygons: np.ndarray, width: float, height: float) -> np.ndarray:
    """The box of each polygon's part inside the image ``[0, width] x [0, height]``: [N, K, 2] to [N, 4] xyxy,
    zeros when none is.

    A polygon inside the image gives its points' extent, one wholly outside (its extent beyond an edge)
    zeros. Otherwise the extent of its points inside the image, of its edges' crossings with the image's
    borders (only the few edges that meet a border are crossed), and of the image's corners that lie inside
    it (or on its outline).
    """
    if len(polygons) == 0 or polygons.shape[1] == 0:
        return np.zeros((len(polygons), 4), polygons.dtype)
    return _boxes(_by_coordinate(polygons), width, height)[0]


def _boxes(coords: np.ndarray, width: float, height: float) -> tuple[np.ndarray, np.ndarray]:
    """:func:`polygon_boxes` of polygons by coordinate (:func:`_by_coordinate`, [2, N, K], K > 0), and the rows
    not wholly inside the image (int64 [M]: those whose box is not their points' extent)."""
    dtype = coords.dtype
    low, high = _extent(coords)                                                     # [N, 2]
    boxes = np.concatenate([low, high], 1)
    inside = (low >= 0).all(1) & (high[:, 0] <= width) & (high[:, 1] <= height)
    off = (high[:, 0] < 0) | (high[:, 1] < 0) | (low[:, 0] > width) | (low[:, 1] > height)
    boxes[off] = 0
    cut = np.flatnonzero(~inside & ~off)
    if not len(cut):
        return boxes, np.flatnonzero(off)
    points = np.take(coords, cut, 1)                                                # [2, M, K]
    step = np.concatenate([points[..., 1:], points[..., :1]], -1) - points          # each edge, the last closing
    size = np.array((width, height), dtype)
    lo, hi = np.empty((len(cut), 2), dtype), np.empty((len(cut), 2), dtype)
    shown = (points >= 0).all(0) & (points[0] <= width) & (points[1] <= height)    # [M, K]
    for k in (0, 1):
        lo[:, k] = points[k].min(1, where=shown, initial=np.inf)
        hi[:, k] = points[k].max(1, where=shown, initial=-np.inf)
    axes = np.array((0, 1, 0, 1))                                                   # x = 0, y = 0, x = w, y = h
    borders = np.array((0, 0, width, height), dtype)
    # only the borders a row's extent reaches: an edge with both ends strictly inside a border's side has no
    # crossing with it (its t is below 0 or above 1)
    reach = np.concatenate([low[cut] <= 0, high[cut] >= size], 1)                  # [M, 4]
    rows, sides = np.nonzero(reach)                                                 # [P]
    ends = points[axes[sides], rows]                                                # [P, K]
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (borders[sides, None] - ends) / step[axes[sides], rows]                 # [P, K]
    p, e = np.nonzero((t >= 0) & (t <= 1))                                         # the few edges that meet a border
    b, r = sides[p], rows[p]
    crossing = points[:, r, e] + t[p, e] * step[:, r, e]                            # [2, C]
    along = crossing[1 - axes[b], np.arange(len(b))]                                # the other coordinate
    crosses = (along >= 0) & (along <= size[1 - axes[b]])
    np.minimum.at(lo, r[crosses], crossing[:, crosses].T)                           # the crossings, by row
    np.maximum.at(hi, r[crosses], crossing[:, crosses].T)
    corners = np.array(((0, 0), (width, 0), (0, height), (width, height)), dtype)
    near = reach[:, [0, 2, 0, 2]] & reach[:, [1, 1, 3, 3]]      # [M, 4]: within the extent (a cut row reaches 0)
    for row, c in zip(*np.nonzero(near), strict=True):                             # the rare corner a polygon covers
        if cv2.pointPolygonTest(np.ascontiguousarray(points[:, row].T, np.float32),
                                (float(corners[c, 0]), float(corners[c, 1])), False) >= 0:
            lo[row], hi[row] = np.minimum(lo[row], corners[c]), np.maximum(hi[row], corners[c])
    found = np.isfinite(lo).all(1)
    boxes[cut] = np.where(found[:, None], np.concatenate([lo, hi], 1), 0)
    return boxes, np.flatnonzero(~inside)


def warp_polygons(polygons: np.ndarray, matrix: np.ndarray, size: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Polygons through a 3 x 3 warp (perspective divide included), their boxes, and the polygons clipped to them.

    Args:
        polygons: [N, K, 2] points in pixels (resampled to one count: :func:`resample_polygon`).
        matrix: the warp, [3, 3].
        size: (width, height) of the output image.

    Returns:
        ``(boxes, polygons)``: [N, 4] xyxy, each polygon's visible part's box (:func:`polygon_boxes`), and the
        warped polygons [N, K, 2] with each point clipped into its box.
    """
    n, k = polygons.shape[:2]
    if n == 0 or k == 0:
        return np.zeros((n, 4), polygons.dtype), polygons
    xy = np.ones((3, n * k), np.result_type(polygons, matrix))
    xy[:2] = polygons.reshape(-1, 2).T
    xy = matrix @ xy                                   # by coordinate: the sums of ``[x, y, 1] @ matrix.T``
    coords = (xy[:2] / xy[2] if (matrix[2] != (0, 0, 1)).any() else xy[:2]).reshape(2, n, k)
    boxes, outside = _boxes(coords, size[0], size[1])
    if len(outside):                                   # each point into its box (a row inside is within its own)
        part = np.take(coords, outside, 1)
        np.maximum(part, np.take(boxes, outside, 0).T[:2, :, None], out=part)
        np.minimum(part, np.take(boxes, outside, 0).T[2:, :, None], out=part)
        coords[:, outside] = part
    return boxes, coords.transpose(1, 2, 0)


# --- an item's rows' polygons through the pipeline ---------------------------------------------------------------


def resampled_rows(rows: Sequence[np.ndarray | None]) -> tuple[np.ndarray, np.ndarray]:
    """An image's rows' polygons resampled to ``POINTS`` points in their own pixels (:func:`resample_polygons`' numbers,
    all point counts in one pass): float32 [G, POINTS, 2] (zeros for a box row), and bool [G], False for a box row."""
    out = np.zeros((len(rows), POINTS, 2), np.float32)
    has = np.array([p is not None for p in rows], bool).reshape(-1)
    polygons = [np.asarray(p).reshape(-1, 2) for p in rows if p is not None]
    if polygons:
        out[has] = _resample_all(polygons)
    return out, has


def _resample_all(polygons: list[np.ndarray], n: int = POINTS) -> np.ndarray:
    """:func:`resample_polygon` of each of ``polygons`` (float [K, 2], any K), back to back: float32 [G, n, 2]."""
    if any(len(p) == n for p in polygons):                  # those as they are: one at a time
        return np.stack([resample_polygon(p, n) for p in polygons])
    closed = np.concatenate([q for p in polygons for q in (p, p[:1])]).astype(np.float64)  # closed, back to back
    tables = [_resample_table(len(p) + 1, n) for p in polygons]
    offsets = np.array([0, *itertools.accumulate(len(p) + 1 for p in polygons[:-1])])
    low = np.concatenate([t[0] for t in tables]) + np.repeat(offsets, n)
    start = np.take(closed, low, 0)                                        # (np.take: far faster than closed[low])
    out = ((np.take(closed[1:], low, 0) - start) * np.concatenate([t[1] for t in tables]) + start)
    out = out.reshape(len(polygons), n, 2)
    for g, (table, end) in enumerate(zip(tables, (offsets + [len(p) for p in polygons]).tolist(), strict=True)):
        out[g, table[2]] = closed[end]                                     # np.interp's exact end point
    return out.astype(np.float32)


def place_rows(resampled: np.ndarray, has: np.ndarray, boxes: np.ndarray, ratio: tuple[float, float]
               ) -> tuple[np.ndarray, np.ndarray]:
    """Rows resampled by :func:`resampled_rows` in pixels of their image resized by ``ratio``; a box row's polygon
    its box's outline (``boxes`` [G, 4] in resized pixels), resampled. Returns ``(polygons, has)`` as
    :func:`row_polygons`."""
    out = resampled * np.array(ratio, np.float32)
    if (~has).any():
        out[~has] = box_outlines(np.asarray(boxes, np.float32).reshape(-1, 4)[~has])
    return out, has


def box_outlines(boxes: np.ndarray) -> np.ndarray:
    """Boxes' outlines as box rows' polygons: float32 [G, 4] xyxy to [G, POINTS, 2], resampled together."""
    x1, y1, x2, y2 = np.asarray(boxes, np.float32).reshape(-1, 4).T
    return resample_polygons(np.stack([x1, y1, x2, y1, x2, y2, x1, y2], 1).reshape(-1, 4, 2))


def row_polygons(rows: Sequence[np.ndarray | None], boxes: np.ndarray, ratio: tuple[float, float]
                 ) -> tuple[np.ndarray, np.ndarray]:
    """An image's rows as polygons of ``POINTS`` points in pixels of the image resized by ``ratio``.

    Args:
        rows: each row's polygon in original pixels (float [K, 2]), or None for a box row.
        boxes: float [G, 4] xyxy, the rows' boxes already in resized pixels.
        ratio: ``(ratio_w, ratio_h)`` from the original.

    Returns:
        ``(polygons, has_mask)``: float32 [G, POINTS, 2], and bool [G], False for a box row, whose polygon is its
        box's outline (so that a warp gives it the box a warped box gets) and whose mask is never drawn.
    """
    return place_rows(*resampled_rows(rows), boxes, ratio)


def scale_polygons(polygons: np.ndarray, ratio: tuple[float, float], pad: tuple[float, float]) -> np.ndarray:
    """``polygons`` [..., 2] scaled by ``ratio`` (w, h) and shifted by ``pad`` (w, h), as ``scale_boxes`` does boxes."""
    return (polygons * np.array(ratio, np.float32) + np.array(pad, np.float32)).astype(np.float32)


def flip_polygons(polygons: np.ndarray, shape: tuple[int, int], *, lr: bool) -> np.ndarray:
    """``polygons`` mirrored in an image of ``shape`` (H, W): left-right (``lr``) or top-bottom."""
    out = polygons.copy()
    axis, size = (0, shape[1]) if lr else (1, shape[0])
    out[..., axis] = size - polygons[..., axis]
    return out


def instance_masks(polygons: np.ndarray, has_mask: np.ndarray, shape: tuple[int, int], ratio: int, *,
                   overlap: bool) -> tuple[np.ndarray, np.ndarray]:
    """An item's masks at 1 / ``ratio`` of its image ``shape`` (H, W), and the order its rows must take.

    Box rows (``has_mask`` False) get no pixel. With ``overlap``, one index map (:func:`overlap_mask`; the rows
    are to be put in the returned order, row k then being value k + 1); else uint8 [G, h, w] and the rows as they
    are (``order`` is ``arange(G)``). Each mask is :func:`polygon_crop`'s, of the polygon's points without their
    repeats: 1,000 points truncated to whole pixels repeat many a pixel one after another, and the fill draws each
    edge, where an edge of no length draws the pixel its neighbours end on; the same masks, the fills in about
    half the time.
    """
    has_mask = np.asarray(has_mask, bool).reshape(-1)
    h, w, r = int(shape[0]), int(shape[1]), int(ratio)
    size = (h // r, w // r)
    polygons = np.asarray(polygons)
    ints = (polygons if polygons.dtype == np.float32 else polygons.astype(np.float64)).astype(np.int32)
    ints = ints.reshape(len(has_mask), -1, 2) if len(has_mask) else np.zeros((0, 1, 2), np.int32)   # [G, K, 2]
    ints = np.ascontiguousarray(ints)
    new = np.ones(ints.shape[:2], bool)              # a point's first of its repeats (one int64 per point: its x and y)
    np.not_equal(ints.view(np.int64)[:, 1:, 0], ints.view(np.int64)[:, :-1, 0], out=new[:, 1:])
    empty = MaskCrop(0, 0, np.zeros((0, 0), np.uint8))
    crops = [polygon_crop(np.compress(n, p, 0), shape, r) if has else empty      # (compress: 2.5x p[n]'s speed)
             for p, n, has in zip(ints, new, has_mask.tolist(), strict=True)]
    if overlap:
        return overlap_of_crops(crops, size)
    masks = np.zeros((len(crops), *size), np.uint8)
    for whole, crop in zip(masks, crops, strict=True):
        _paste(whole, crop)
    return masks, np.arange(len(masks), dtype=np.int64)


def copy_paste(image: np.ndarray, boxes: np.ndarray, classes: np.ndarray, polygons: np.ndarray, has_mask: np.ndarray,
               fraction: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The image's objects mirrored left-right and pasted onto it (the reference's copy-paste, "flip" mode).

    A mirrored object is a candidate when it covers less than 30% of every object's box (its box's
    intersection with that box, over that box's area); candidates are taken least overlapping first,
    ``round(fraction * candidates)`` of them. Each is painted from the mirrored image through its polygon's
    fill and added as a row. Box rows (no polygon) are never pasted.

    Returns:
        image (a new array), and boxes, classes, polygons, has_mask with the pasted rows after the others.
    """
    h, w = image.shape[:2]
    mirrored_boxes = boxes.copy()
    mirrored_boxes[:, 0], mirrored_boxes[:, 2] = w - boxes[:, 2], w - boxes[:, 0]
    mirrored = flip_polygons(polygons, (h, w), lr=True)
    lo = np.maximum(mirrored_boxes[:, None, :2], boxes[None, :, :2])
    hi = np.minimum(mirrored_boxes[:, None, 2:], boxes[None, :, 2:])
    inter = np.clip(hi - lo, 0, None).prod(-1)
    area = np.maximum((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]), 1e-7)
    ioa = inter / area[None, :]                                        # [mirrored, existing]
    candidates = np.flatnonzero((ioa < 0.30).all(1) & np.asarray(has_mask, bool))
    candidates = candidates[np.argsort(ioa.max(1)[candidates], kind="stable")]
    taken = candidates[:round(fraction * len(candidates))]
    if not len(taken):
        return image, boxes, classes, polygons, has_mask
    paint = np.zeros((h, w), np.uint8)
    for j in taken:                  # one at a time: contours drawn together fill their overlaps by parity
        cv2.drawContours(paint, [mirrored[j].astype(np.int32)], -1, 1, cv2.FILLED)
    image = image.copy()
    where = paint.astype(bool)
    image[where] = cv2.flip(np.ascontiguousarray(image), 1)[where]
    return (image, np.concatenate([boxes, mirrored_boxes[taken]]).astype(np.float32),
            np.concatenate([classes, np.asarray(classes)[taken]]), np.concatenate([polygons, mirrored[taken]]),
            np.concatenate([np.asarray(has_mask, bool), np.ones(len(taken), bool)]))
