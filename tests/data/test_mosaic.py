"""Mosaic of four and MixUp."""

from __future__ import annotations

import numpy as np
import pytest

from yolokit.data import mixup, mosaic4, random_affine

from .conftest import COLOURS, colour_extent


def _four_samples(size: int):
    """Four images (different sizes, long side <= size), one filled rectangle each.

    Each rectangle covers most of its image, so the Mosaic cut usually crosses it.
    """
    shapes = [(size, size), (size * 3 // 4, size), (size, size // 2), (size // 2, size // 2)]
    samples = []
    for k, (h, w) in enumerate(shapes):
        image = np.zeros((h, w, 3), np.uint8)
        x1, y1, x2, y2 = w // 8, h // 8, w - w // 8, h - h // 8
        image[y1:y2, x1:x2] = COLOURS[k]
        samples.append((image, np.array([[x1, y1, x2, y2]], np.float32), np.array([k])))
    return samples


def _check_boxes(image, boxes, classes, tol):
    for box, k in zip(boxes, classes, strict=True):
        extent = colour_extent(image, int(k))
        assert extent is not None
        np.testing.assert_allclose(box, extent, atol=tol, err_msg=f"colour {k}")


@pytest.mark.parametrize("seed", range(8))
def test_mosaic_canvas_size_and_boxes_on_shown_pixels(seed):
    size = 64
    canvas, boxes, classes = mosaic4(_four_samples(size), size, np.random.default_rng(seed))
    assert canvas.shape == (2 * size, 2 * size, 3) and canvas.dtype == np.uint8
    assert (boxes >= 0).all() and (boxes <= 2 * size).all()
    # boxes are clipped to the part of their image that is shown, exactly
    _check_boxes(canvas, boxes, classes, tol=0)
    # every colour that is visible has its box
    visible = {k for k in range(4) if colour_extent(canvas, k) is not None}
    assert visible == set(classes.tolist())


@pytest.mark.parametrize("seed", range(6))
def test_mosaic_then_affine_back_to_size(seed):
    size = 64
    rng = np.random.default_rng(seed)
    canvas, boxes, classes = mosaic4(_four_samples(size), size, rng)
    image, boxes, classes = random_affine(canvas, boxes, classes, rng, out_shape=(size, size),
                                          translate=0.1, scale=0.5)
    assert image.shape == (size, size, 3)
    assert (boxes[:, [0, 2]] >= 0).all() and (boxes[:, [0, 2]] <= size).all()
    assert (boxes[:, [1, 3]] >= 0).all() and (boxes[:, [1, 3]] <= size).all()
    assert ((boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])).all()
    _check_boxes(image, boxes, classes, tol=1.5)


def test_mosaic_centre_is_random_and_fills_with_grey():
    size = 32
    samples = [(np.zeros((8, 8, 3), np.uint8), np.zeros((0, 4), np.float32), np.zeros(0))] * 4
    centres = set()
    for seed in range(10):
        canvas, boxes, classes = mosaic4(samples, size, np.random.default_rng(seed))
        assert len(boxes) == 0 and len(classes) == 0
        black = np.argwhere(canvas.max(-1) == 0)  # the four tiny images meet at the centre
        centre = tuple(black.min(0) + 8)
        assert size // 2 <= centre[0] < 3 * size // 2 and size // 2 <= centre[1] < 3 * size // 2
        centres.add(centre)
        assert (canvas.max(-1) == 114).sum() == (2 * size) ** 2 - 4 * 64
    assert len(centres) > 5


def test_mosaic_needs_four():
    with pytest.raises(ValueError):
        mosaic4(_four_samples(32)[:3], 32, np.random.default_rng(0))


def test_mixup_blends_and_keeps_both_box_sets():
    a = (np.full((16, 16, 3), 200, np.uint8), np.array([[0, 0, 8, 8]], np.float32), np.array([0]))
    b = (np.full((16, 16, 3), 100, np.uint8), np.array([[4, 4, 16, 16], [1, 1, 3, 3]],
                                                         np.float32), np.array([1, 2]))
    image, boxes, classes = mixup(a, b, np.random.default_rng(0))
    assert image.shape == (16, 16, 3)
    assert 130 < image[0, 0, 0] < 170  # Beta(32, 32) weights stay near one half
    assert len(np.unique(image)) == 1
    np.testing.assert_array_equal(boxes, np.concatenate([a[1], b[1]]))
    assert classes.tolist() == [0, 1, 2]


@pytest.mark.parametrize("seed", range(4))
def test_lazy_canvas_paints_the_same_pixels(seed):
    from yolokit.data.augment.mosaic import mosaic4_canvas

    samples = _four_samples(48)
    canvas, boxes, classes = mosaic4(samples, 48, np.random.default_rng(seed))
    lazy, lazy_boxes, lazy_classes = mosaic4_canvas(samples, 48, np.random.default_rng(seed))
    np.testing.assert_array_equal(np.asarray(lazy), canvas)
    np.testing.assert_array_equal(lazy_boxes, boxes)
    np.testing.assert_array_equal(lazy_classes, classes)
    painted = np.full((96, 96, 3), 114, np.uint8)            # painted here, independently: grey, then the tiles
    rng = np.random.default_rng(seed)
    xc, yc = (int(v) for v in rng.integers(24, 72, 2))
    for k, (image, _, _) in enumerate(samples):
        h, w = image.shape[:2]
        x0, y0 = (xc - w if k in (0, 2) else xc), (yc - h if k in (0, 1) else yc)
        for y in range(max(y0, 0), min(y0 + h, 96)):
            xs = slice(max(x0, 0), min(x0 + w, 96))
            painted[y, xs] = image[y - y0, xs.start - x0:xs.stop - x0]
    np.testing.assert_array_equal(canvas, painted)
    for rows, cols in ((slice(0, 96), slice(0, 96)), (slice(10, 70), slice(33, 34)), (slice(40, 40), slice(0, 5)),
                       (slice(50, 200), slice(-20, None)), (slice(0, 30), slice(0, 30)), (slice(60, 96), slice(5, 90))):
        np.testing.assert_array_equal(lazy[rows, cols], painted[rows, cols])
    for _ in range(20):                                       # any region: each pixel a tile's or grey, once
        y0, x0 = rng.integers(0, 96, 2)
        y1, x1 = y0 + rng.integers(0, 96 - y0 + 1), x0 + rng.integers(0, 96 - x0 + 1)
        np.testing.assert_array_equal(lazy[y0:y1, x0:x1], painted[y0:y1, x0:x1])
    # the affine reads only what it needs: same output from the lazy and the painted canvas
    a = random_affine(canvas, boxes, classes, np.random.default_rng(seed), out_shape=(48, 48))
    b = random_affine(lazy, boxes, classes, np.random.default_rng(seed), out_shape=(48, 48))
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
