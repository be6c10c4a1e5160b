"""The 9-image Mosaic (``AugmentConfig(mosaic_tiles=9)``): laid out as the reference lays it out
(fixtures/mosaic9.pt, written by fixtures/make_mosaic9.py with the reference's own Mosaic), a detection item
of nine images, and the refusals. Its masks through a training item: test_segment_items.py."""

from pathlib import Path

import numpy as np
import pytest
import torch

from yolokit.data import DetectionDataset, build_dataloader, make_shapes
from yolokit.data.augment.mosaic import mosaic4_polygons, mosaic9_rows
from yolokit.data.augment.transforms import AugmentConfig

REFERENCE = torch.load(Path(__file__).parent / "fixtures" / "mosaic9.pt", weights_only=True)


def test_nine_samples_are_laid_out_clipped_and_dropped_as_the_reference_does():
    samples = [(s["image"].numpy(), s["boxes"].numpy(), s["classes"].numpy()) for s in REFERENCE["samples"]]
    canvas, boxes, classes, kept = mosaic9_rows(samples, REFERENCE["size"])
    assert np.array_equal(np.asarray(canvas), REFERENCE["image"].numpy())       # later tiles over earlier ones
    assert np.array_equal(boxes, REFERENCE["boxes"].numpy()) and np.array_equal(classes, REFERENCE["classes"].numpy())
    polygons = mosaic4_polygons([s["polygons"].numpy() for s in REFERENCE["samples"]], canvas, kept)
    assert np.array_equal(polygons, REFERENCE["polygons"].numpy())
    assert sum(len(k) for k in kept) < sum(len(s[1]) for s in samples)           # rows cut to nothing are dropped
    assert not np.asarray(canvas).flags.writeable                                 # a view: read-only


@pytest.fixture(scope="module")
def seg(tmp_path_factory):
    return make_shapes(tmp_path_factory.mktemp("seg9") / "set", n_train=12, n_val=4, imgsz=96, max_objects=1,
                       background_fraction=0.0, segments=True)


def test_nine_tiles_for_boxes_and_their_refusals(seg):
    hyp = AugmentConfig(mosaic=1.0, mosaic_tiles=9)
    ds = DetectionDataset(seg, "train", imgsz=96, augment=True, hyp=hyp, buffer_size=0)
    rows = [len(ds[i]["boxes"]) for i in range(len(ds))]
    assert max(rows) >= 3 and all(((ds[i]["boxes"] >= 0) & (ds[i]["boxes"] <= 96)).all() for i in range(3))
    with pytest.raises(ValueError, match="mosaic_tiles must be 4 or 9, got 6"):
        AugmentConfig(mosaic_tiles=6)
    with pytest.raises(ValueError, match="augment_on='device' lays out Mosaics of 4 images only"):
        build_dataloader(ds, 4, workers=0, augment_on="device")
