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
