"""Transforms keep boxes on the pixels they bound."""

from __future__ import annotations

import numpy as np
import pytest

from yolokit.data import (
    AugmentConfig,
    augment_hsv,
    flip_lr,
    flip_ud,
    letterbox,
    random_affine,
    scale_boxes,
)
from yolokit.data.augment.transforms import affine_matrix, box_candidates, transform_boxes

from .conftest import colour_extent, draw_rects

RECTS = [(10, 12, 40, 30), (60, 8, 90, 50), (20, 60, 45, 110), (70, 70, 118, 100),
         (0, 40, 12, 55), (100, 110, 128, 120)]  # the last two touch the borders


def _sample():
    image = draw_rects((120, 128), RECTS)
    boxes = np.array(RECTS, np.float32)
    return image, boxes, np.arange(len(RECTS))


def _assert_boxes_on_pixels(image, boxes, classes, tol):
    assert len(boxes) == len(classes)
    for box, k in zip(boxes, classes, strict=True):
        extent = colour_extent(image, int(k))
        assert extent is not None, f"box {box} of colour {k} has no pixels"
        np.testing.assert_allclose(box, extent, atol=tol, err_msg=f"colour {k}")


def test_defaults_are_yolov8():
    hyp = AugmentConfig()
    assert (hyp.hsv_h, hyp.hsv_s, hyp.hsv_v) == (0.015, 0.7, 0.4)
    assert (hyp.degrees, hyp.translate, hyp.scale) == (0, 0.1, 0.5)
    assert (hyp.shear, hyp.perspective) == (0, 0)
    assert (hyp.flipud, hyp.fliplr, hyp.mosaic, hyp.mixup) == (0, 0.5, 1.0, 0)


def test_letterbox_shape_ratio_pad_and_grey():
    image = np.full((480, 640, 3), 7, np.uint8)
    out, (ratio, pad) = letterbox(image, 320)
    assert out.shape == (320, 320, 3) and ratio == (0.5, 0.5) and pad == (0.0, 40.0)
    assert (out[:40] == 114).all() and (out[-40:] == 114).all() and (out[40:280] == 7).all()
    out, (ratio, pad) = letterbox(image, 320, auto=True, stride=32)
    assert out.shape == (256, 320, 3) and pad == (0.0, 8.0)  # 240 -> next multiple of 32
    out, (ratio, pad) = letterbox(np.zeros((100, 50, 3), np.uint8), 320, scaleup=False)
    assert ratio == (1.0, 1.0) and pad == (135.0, 110.0) and out.shape == (320, 320, 3)
    out, (ratio, pad) = letterbox(np.zeros((333, 500, 3), np.uint8), (256, 320))
    assert out.shape == (256, 320, 3)
    assert ratio == (320 / 500, 213 / 333)  # exact per-axis ratio of the integer sizes
    same = np.full((320, 320, 3), 9, np.uint8)
    out, ratio_pad = letterbox(same, 320)
    assert out is same and ratio_pad == ((1.0, 1.0), (0.0, 0.0))  # nothing to do: no copy


def test_letterbox_boxes_follow_pixels():
    image, boxes, classes = _sample()
    for size, auto in [(320, False), (64, False), ((96, 200), False), (200, True)]:
        out, (ratio, pad) = letterbox(image, size, auto=auto)
        _assert_boxes_on_pixels(out, scale_boxes(boxes, ratio, pad), classes, tol=1.01)
        # ratio_pad maps back: original = (letterboxed - pad) / ratio
        back = (scale_boxes(boxes, ratio, pad) - np.array(pad * 2)) / np.array(ratio * 2)
        np.testing.assert_allclose(back, boxes, atol=1e-3)


def test_flips_are_exact():
    image, boxes, classes = _sample()
    out, new = flip_lr(image, boxes)
    _assert_boxes_on_pixels(out, new, classes, tol=0)
    out, new = flip_ud(image, boxes)
    _assert_boxes_on_pixels(out, new, classes, tol=0)


@pytest.mark.parametrize("params", [
    dict(translate=0.1, scale=0.5),
    dict(degrees=30.0, translate=0.1, scale=0.3),
    dict(degrees=10.0, shear=10.0, scale=0.2),
    dict(perspective=0.0008, translate=0.05, scale=0.2),
])
def test_random_affine_keeps_boxes_on_pixels(params):
    """Boxes equal the drawn pixels' extent; a box cut by the border still contains them.

    (A rotated rectangle cut by the border has a visible part smaller than its clipped
    corner box, so for those only containment holds.)
    """
    image, boxes, classes = _sample()
    exact = 0
    for seed in range(6):
        out, new, cls = random_affine(image, boxes, classes, np.random.default_rng(seed), **params)
        m, _ = affine_matrix(np.random.default_rng(seed), (120, 128), (120, 128), **params)
        unclipped = transform_boxes(boxes, m)[cls]
        assert out.shape == image.shape
        assert (new[:, [0, 2]] >= 0).all() and (new[:, [0, 2]] <= 128).all()
        assert (new[:, [1, 3]] >= 0).all() and (new[:, [1, 3]] <= 120).all()
        axis_aligned = not any(params.get(k) for k in ("degrees", "shear", "perspective"))
        for box, full, k in zip(new, unclipped, cls, strict=True):
            extent = colour_extent(out, int(k))
            assert extent is not None, f"box {box} of colour {k} has no pixels"
            inside = full[0] >= 0 and full[1] >= 0 and full[2] <= 128 and full[3] <= 120
            if inside or axis_aligned:
                np.testing.assert_allclose(box, extent, atol=1.5, err_msg=f"colour {k}")
                exact += 1
            else:
                assert (box[:2] <= extent[:2] + 1.5).all() and (box[2:] >= extent[2:] - 1.5).all()
        for k in set(range(len(RECTS))) - set(cls.tolist()):  # dropped: (almost) nothing left
            extent = colour_extent(out, k)
            if extent is not None:
                w, h = extent[2] - extent[0], extent[3] - extent[1]
                orig = (RECTS[k][2] - RECTS[k][0]) * (RECTS[k][3] - RECTS[k][1])
                assert w <= 3 or h <= 3 or w * h < 0.25 * orig * (1 + params["scale"]) ** 2
    assert exact >= 12  # plenty of boxes were compared exactly


def test_random_affine_to_other_size_and_fill():
    image, boxes, classes = _sample()
    rng = np.random.default_rng(1)
    out, new, cls = random_affine(image, boxes, classes, rng, out_shape=(64, 80),
                                  translate=0, scale=0)
    assert out.shape == (64, 80, 3)
    _assert_boxes_on_pixels(out, new, cls, tol=1.5)


def test_transform_boxes_identity_and_shift():
    boxes = np.array([[1, 2, 30, 40]], np.float32)
    np.testing.assert_allclose(transform_boxes(boxes, np.eye(3)), boxes, atol=1e-5)
    m = np.eye(3)
    m[0, 2], m[1, 2] = 5, -2
    np.testing.assert_allclose(transform_boxes(boxes, m), boxes + [5, -2, 5, -2], atol=1e-5)
    # a 2x zoom about the pixel-centre origin doubles the edge box and shifts it half a pixel
    np.testing.assert_allclose(transform_boxes(boxes, np.diag([2.0, 2.0, 1.0])),
                               boxes * 2 - 0.5, atol=1e-5)


def test_box_candidates_thresholds():
    before = np.array([[0, 0, 10, 10]] * 4, np.float32)
    after = np.array([[0, 0, 10, 10],     # kept
                      [0, 0, 1.5, 10],    # under 2 px wide
                      [0, 0, 3, 3],       # 9% of the area
                      [0, 0, 2.5, 300]],  # aspect 120
                     np.float32)
    assert box_candidates(before, after).tolist() == [True, False, False, False]
    # with a 0.5 zoom, a quarter of the area is all that remains and it is kept
    assert box_candidates(before[:1], np.array([[0, 0, 5, 5]], np.float32), scale=0.5)[0]


def test_hsv_identity_when_off_and_geometry_kept():
    image, boxes, classes = _sample()
    rng = np.random.default_rng(0)
    assert augment_hsv(image, rng, h=0, s=0, v=0) is image
    changed = 0
    for seed in range(5):
        out = augment_hsv(image, np.random.default_rng(seed))
        assert out.shape == image.shape and out.dtype == np.uint8
        changed += int((out != image).any())
        # background stays black (value gain of 0 stays 0) and shapes stay where they were
        assert (out[image.max(-1) == 0] == 0).all()
        assert (out[image.max(-1) > 0].max(-1) > 0).all()
    assert changed == 5


def test_scale_translate_fast_path_matches_a_warp():
    """Without rotation/shear/perspective the affine step resizes and pastes instead of
    warping: the same picture to within half a pixel of offset."""
    import cv2

    from yolokit.data.augment.transforms import _resize_and_paste

    yy, xx = np.mgrid[0:120, 0:128].astype(np.float32)
    image = np.stack([xx * 2, yy * 2, (xx + yy)], -1).clip(0, 255).astype(np.uint8)
    boxes = np.array(RECTS, np.float32)
    for seed in range(10):
        out_shape = (120, 128) if seed % 2 else (64, 96)
        m, _ = affine_matrix(np.random.default_rng(seed), (120, 128), out_shape,
                             translate=0.2, scale=0.5)
        fast, exact = _resize_and_paste(image, m, out_shape, 114)
        warp = cv2.warpAffine(image, m[:2], out_shape[::-1], borderValue=(114, 114, 114))
        assert fast.shape == warp.shape == (*out_shape, 3)
        # the realised transform differs by under a pixel anywhere in the output
        corners = np.array([[0, 0, 1], [127, 119, 1]], np.float64)
        assert np.abs(corners @ exact.T - corners @ m.T).max() <= 1.0
        np.testing.assert_allclose(transform_boxes(boxes, exact), transform_boxes(boxes, m),
                                   atol=1.0)
        inner = (slice(2, out_shape[0] - 2), slice(2, out_shape[1] - 2))
        same_fill = (fast[inner] == 114).all(-1) == (warp[inner] == 114).all(-1)
        assert same_fill.mean() > 0.95
        both = ~(fast[inner] == 114).all(-1) & ~(warp[inner] == 114).all(-1)
        diff = np.abs(fast[inner].astype(int) - warp[inner].astype(int)).max(-1)[both]
        assert diff.mean() < 3
        bright, _ = _resize_and_paste(image // 2 + 120, m, out_shape, 114)   # no grey in the picture
        shown = ~(bright == 114).all(-1)                                    # a rectangle, grey all around it
        ys, xs = np.nonzero(shown)
        assert shown[ys.min():ys.max() + 1, xs.min():xs.max() + 1].all() and shown.sum() == (
            (ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))
        assert (bright[~shown] == 114).all() and (bright[shown] >= 120).all()


def test_the_hue_moves_by_a_gain_or_by_the_reference_84s_shift_from_the_same_draws():
    """``AugmentConfig.hue_mode``: "gain" (the default) multiplies the hue, "shift" adds to it as the reference
    8.4's RandomHSV does (its formula in float64); saturation and value tables and the draws are the same."""
    from yolokit.data.augment.transforms import hsv_lut

    gain, shift = hsv_lut(np.random.default_rng(3), hue="gain"), hsv_lut(np.random.default_rng(3), hue="shift")
    r = np.random.default_rng(3).uniform(-1, 1, 3) * [0.015, 0.7, 0.4]
    x = np.arange(256, dtype=np.float64)
    np.testing.assert_array_equal(shift[0], ((x + r[0] * 180) % 180).astype(np.uint8))
    np.testing.assert_array_equal(gain[0], ((np.arange(256, dtype=np.float32) * (r[0] + 1)) % 180).astype(np.uint8))
    np.testing.assert_array_equal(gain[1:], shift[1:])
    assert (gain[0] != shift[0]).sum() > 100                          # the two modes move hues differently
    with pytest.raises(ValueError, match="hue_mode must be 'gain' or 'shift'"):
        AugmentConfig(hue_mode="add")
