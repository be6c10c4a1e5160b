"""Polygons resampled and rasterized as the reference does (fixtures/polygon-masks.pt, written by
fixtures/make_polygon_masks.py with the reference's own functions)."""

from pathlib import Path

import numpy as np
import pytest
import torch

from yolokit.data.augment.polygons import overlap_mask, polygon_masks, resample_polygon

REFERENCE = torch.load(Path(__file__).parent / "fixtures" / "polygon-masks.pt", weights_only=True)
POLYGONS = [p.numpy() for p in REFERENCE["polygons"]]


def test_resampling_keeps_the_outline_and_equals_the_references():
    for ours, theirs, original in zip(map(resample_polygon, POLYGONS), REFERENCE["resampled"], POLYGONS,
                                      strict=True):
        assert ours.dtype == np.float32 and np.array_equal(ours, theirs.numpy())
        if len(original) < 1000:                       # the outline's own points are among the new ones
            assert len(ours) == 1000 and all((ours == p).all(1).any() for p in original)
    assert len(resample_polygon(POLYGONS[-2])) == 1000 and np.array_equal(resample_polygon(POLYGONS[-1]),
                                                                          POLYGONS[-1])


@pytest.mark.parametrize("ratio", [1, 4])
def test_masks_and_the_index_map_equal_the_references(ratio):
    """Per-object masks and the overlap index map at mask ratios 1 and 4, pixel for pixel, and the objects'
    order in the map: largest first, smaller ones over larger, one without a pixel at ratio 4 first of all."""
    ref = REFERENCE["cases"][ratio]
    masks = polygon_masks(POLYGONS, REFERENCE["shape"], ratio)
    assert masks.dtype == np.uint8 and np.array_equal(masks, ref["masks"].numpy())
    index, order = overlap_mask(POLYGONS, REFERENCE["shape"], ratio)
    assert np.array_equal(index.astype(np.int32), ref["index"].numpy()) and np.array_equal(order, ref["order"].numpy())
    areas = masks.reshape(len(masks), -1).sum(1)
    if ratio == 4:
        assert areas[order[0]] == 0 and (np.diff(areas[order[1:]].astype(np.int64)) <= 0).all()
    assert set(np.unique(index)) <= set(range(len(POLYGONS) + 1)) and len(np.unique(index)) > 6


def test_no_polygon_is_an_empty_map():
    index, order = overlap_mask([], (64, 96), 4)
    assert index.shape == (16, 24) and not index.any() and order.shape == (0,)
    assert polygon_masks([], (64, 96), 4).shape == (0, 16, 24)


def test_warped_polygons_give_the_references_boxes_and_clipped_points():
    """Four warps (a shift off the image's edges, a rotation with scale, a shear, a perspective): each polygon's
    box is its visible part's (edge crossings and image corners inside it included; zeros when wholly off),
    its points clipped into that box, as the reference's random perspective computes them."""
    from yolokit.data.augment.polygons import warp_polygons

    stacked = np.stack([resample_polygon(p) for p in POLYGONS[:6]])
    h, w = REFERENCE["shape"]
    off = 0
    for warp in REFERENCE["warps"]:
        boxes, points = warp_polygons(stacked.copy(), warp["matrix"].numpy(), (w, h))
        assert np.array_equal(boxes, warp["boxes"].numpy())
        assert np.array_equal(points.astype(np.float32), warp["points"].numpy())
        off += int((boxes == 0).all(1).sum())
        clipped = (boxes[:, 0] == 0) | (boxes[:, 1] == 0) | (boxes[:, 2] == w) | (boxes[:, 3] == h)
        assert (points[..., 0] >= boxes[:, None, 0]).all() and (points[..., 1] <= boxes[:, None, 3]).all()
        assert clipped.any() or off
    assert off >= 2                                                   # polygons wholly off the image: zeros


@pytest.mark.parametrize("shape,ratio", [((96, 128), 4), ((96, 128), 2), ((64, 64), 1), ((66, 70), 4)])
def test_a_mask_drawn_in_its_box_equals_the_mask_drawn_whole(shape, ratio):
    """``polygon_crop`` draws a polygon only in its points' box (a whole image when the sides are not
    multiples of the ratio): pasted back, the same pixels as ``polygon_mask``, also for polygons partly or
    wholly off the image, thin ones and one larger than the image."""
    from yolokit.data.augment.polygons import polygon_crop, polygon_mask

    rng = np.random.default_rng(3)
    h, w = shape
    polygons = [np.array([[-500, -500], [w + 500, -400], [w + 300, h + 600], [-300, h + 500]], np.float32),
                np.array([[w + 5, 3], [w + 30, 9], [w + 12, 40]], np.float32),          # wholly to the right
                np.array([[2.7, 5.2], [60.9, 5.9], [61.3, 7.1]], np.float32)]          # thin
    for _ in range(60):
        centre = rng.uniform(-0.3, 1.3, 2) * (w, h)
        angles = np.sort(rng.uniform(0, 2 * np.pi, int(rng.integers(3, 30))))
        radius = rng.uniform(0.5, 60) * rng.uniform(0.4, 1.0, (len(angles), 1))
        polygons.append((centre + radius * np.stack([np.cos(angles), np.sin(angles)], 1)).astype(np.float32))
    drawn_in_part = 0
    for p in polygons:
        whole = np.zeros((h // ratio, w // ratio), np.uint8)
        top, left, crop = polygon_crop(p, shape, ratio)
        whole[top:top + crop.shape[0], left:left + crop.shape[1]] = crop
        assert np.array_equal(whole, polygon_mask(p, shape, ratio))
        drawn_in_part += crop.size < whole.size
    assert drawn_in_part > 40 if h % ratio == 0 and w % ratio == 0 else drawn_in_part == 0


def test_polygons_resampled_together_equal_each_resampled_alone():
    from yolokit.data.augment.polygons import resample_polygons, row_polygons

    rng = np.random.default_rng(4)
    for count in (3, 4, 17, 999, 1200):
        stack = rng.uniform(-5, 700, (5, count, 2)).astype(np.float32)
        assert np.array_equal(resample_polygons(stack), np.stack([resample_polygon(p) for p in stack]))
    rows = [rng.uniform(0, 300, (k, 2)).astype(np.float32) if k else None for k in (5, 0, 5, 12, 0, 5)]
    boxes = np.array([[10, 20, 40, 60]] * 6, np.float32) + np.arange(6, dtype=np.float32)[:, None]
    polygons, has = row_polygons(rows, boxes, (0.5, 2.0))
    for k, row in enumerate(rows):
        x1, y1, x2, y2 = boxes[k]
        alone = resample_polygon(row) * np.float32([0.5, 2.0]) if row is not None else \
            resample_polygon(np.array([[x1, y1], [x2, y1], [x2, y2], [x1, y2]], np.float32))
        assert np.array_equal(polygons[k], alone) and has[k] == (row is not None)


@pytest.mark.parametrize("overlap", [False, True])
def test_masks_of_points_without_their_repeats_equal_the_masks_of_all_points(overlap):
    """``instance_masks`` fills each polygon without the points that repeat the one before (after truncation to
    whole pixels, most of a small outline's 1,000 points): the same masks as ``polygon_mask`` of all its points,
    for small, thin and one-pixel outlines, ones partly off the image, and a box row (no pixel)."""
    from yolokit.data.augment.polygons import instance_masks, polygon_mask, resample_polygons

    rng = np.random.default_rng(7)
    shape, ratio = (96, 128), 4
    rows = [np.array([[10.2, 10.7], [10.9, 10.1], [10.5, 10.4]]),                    # one pixel
            np.array([[3.5, 40.2], [90.7, 41.1], [91.3, 41.9], [4.1, 41.6]]),         # thin
            np.array([[-20.0, -8.0], [30.0, -5.0], [25.0, 30.0]]),                    # partly off
            np.array([[50.0, 50.0], [50.0, 50.0], [50.0, 50.0]])]                     # all one point
    for _ in range(30):
        centre = rng.uniform(0, 1, 2) * (128, 96)
        angles = np.sort(rng.uniform(0, 2 * np.pi, int(rng.integers(3, 12))))
        rows.append(centre + rng.uniform(1, 25) * np.stack([np.cos(angles), np.sin(angles)], 1))
    polygons = np.concatenate([resample_polygons(np.asarray(p, np.float32)[None]) for p in rows])   # [G, 1000, 2]
    has = np.ones(len(polygons), bool)
    has[5] = False
    masks, order = instance_masks(polygons, has, shape, ratio, overlap=overlap)
    expected = np.stack([polygon_mask(p, shape, ratio) if k else np.zeros((24, 32), np.uint8)
                         for p, k in zip(polygons, has, strict=True)])
    repeats = (polygons.astype(np.int32)[:, 1:] == polygons.astype(np.int32)[:, :-1]).all(2).sum(1)
    assert repeats.min() > 500                                          # most points repeat the one before
    if overlap:
        assert np.array_equal(masks > 0, expected[has].any(0))
        for value, k in enumerate(order, 1):                            # each object where no later one is
            later = (masks > value)
            assert np.array_equal((masks == value), expected[k].astype(bool) & ~later)
    else:
        assert np.array_equal(masks, expected) and expected.any((1, 2)).sum() >= 30
