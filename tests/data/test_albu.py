"""The albumentations adapter keeps boxes in step with the image."""

from __future__ import annotations

import numpy as np
import pytest

A = pytest.importorskip("albumentations")

from yolokit.data import Albumentations  # noqa: E402

from .conftest import colour_extent, draw_rects  # noqa: E402

RECTS = [(10, 12, 40, 30), (60, 8, 90, 50), (20, 60, 45, 110), (70, 70, 118, 100)]


def _sample():
    return (draw_rects((120, 128), RECTS), np.array(RECTS, np.float32),
            np.arange(len(RECTS), dtype=np.int64))


def test_identity_round_trip_is_exact():
    image, boxes, classes = _sample()
    aug = Albumentations(A.Compose([A.NoOp()]))
    out, new, cls = aug(image, boxes, classes, np.random.default_rng(0))
    np.testing.assert_array_equal(out, image)  # BGR in, BGR out
    np.testing.assert_allclose(new, boxes, atol=1e-4)
    assert cls.tolist() == classes.tolist() and cls.dtype == np.int64


def test_rgb_is_what_albumentations_sees():
    image = np.zeros((8, 8, 3), np.uint8)
    image[..., 2] = 255  # pure red in BGR
    seen = {}

    def spy(img, **kwargs):
        seen["pixel"] = img[0, 0].tolist()
        return img

    aug = Albumentations([A.Lambda(image=spy)])
    aug(image, np.zeros((0, 4), np.float32), np.zeros(0, np.int64), np.random.default_rng(0))
    assert seen["pixel"] == [255, 0, 0]


@pytest.mark.parametrize("transforms", [
    [A.HorizontalFlip(p=1.0)],
    [A.VerticalFlip(p=1.0)],
    [A.Affine(translate_px=(-10, 10), scale=(0.8, 1.2), p=1.0)],
    [A.RandomCrop(96, 100, p=1.0)],
    [A.Resize(60, 64, p=1.0)],
])
def test_geometric_transforms_keep_boxes_on_pixels(transforms):
    image, boxes, classes = _sample()
    aug = Albumentations(transforms)
    for seed in range(3):
        out, new, cls = aug(image, boxes, classes, np.random.default_rng(seed))
        assert len(new) == len(cls) and new.dtype == np.float32
        for box, k in zip(new, cls, strict=True):
            extent = colour_extent(out, int(k))
            assert extent is not None
            np.testing.assert_allclose(box, extent, atol=1.5)


def test_randomness_comes_from_our_generator():
    image, boxes, classes = _sample()
    aug = Albumentations([A.Affine(translate_px=(-20, 20), p=1.0)])
    a = aug(image, boxes, classes, np.random.default_rng(5))
    b = aug(image, boxes, classes, np.random.default_rng(5))
    c = aug(image, boxes, classes, np.random.default_rng(6))
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[1], c[1])


def test_empty_boxes():
    image, _, _ = _sample()
    aug = Albumentations([A.HorizontalFlip(p=1.0)])
    out, new, cls = aug(image, np.zeros((0, 4), np.float32), np.zeros(0, np.int64),
                        np.random.default_rng(0))
    assert out.shape == image.shape and new.shape == (0, 4) and cls.shape == (0,)
