"""Bad input never crashes a run and is never dropped silently: file by file."""

from __future__ import annotations

import logging
from pathlib import Path

import cv2
import numpy as np
import pytest

from yolokit.data import DatasetError, DetectionDataset, build_dataloader
from yolokit.data.sources.readers import yolo_index

from .conftest import colour_extent, draw_rects, write_yolo_dataset

RECT = (8, 6, 40, 30)  # x1, y1, x2, y2 on a 64 x 48 image
GOOD_ROW = "0 0.375 0.375 0.5 0.5\n"  # exactly RECT


def _jpeg(image=None, quality=95) -> bytes:
    image = draw_rects((48, 64), [RECT]) if image is None else image
    ok, buf = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, quality])
    assert ok
    return buf.tobytes()


def _png(image) -> bytes:
    ok, buf = cv2.imencode(".png", image)
    assert ok
    return buf.tobytes()


def _exif_rotated_jpeg() -> tuple[bytes, str]:
    """Raw pixels stored sideways with EXIF orientation 6 (display = rotate 90 cw)."""
    from io import BytesIO

    from PIL import Image

    upright = draw_rects((64, 48), [(4, 10, 20, 50)])  # h=64, w=48 as displayed
    raw = np.ascontiguousarray(np.rot90(upright, k=1))  # stored 90 degrees counter-clockwise
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = BytesIO()
    Image.fromarray(raw[..., ::-1]).save(buf, format="JPEG", quality=98, exif=exif.tobytes())
    # label in displayed coordinates: rect (4, 10, 20, 50) on 48 x 64
    return buf.getvalue(), f"0 {12 / 48} {30 / 64} {16 / 48} {40 / 64}\n"


# name -> (image, label text or None, expected action or None, reason fragment)
def _cases():
    good = _jpeg()
    exif_bytes, exif_label = _exif_rotated_jpeg()
    gray = cv2.cvtColor(draw_rects((48, 64), [RECT]), cv2.COLOR_BGR2GRAY)
    rgba = cv2.cvtColor(draw_rects((48, 64), [RECT]), cv2.COLOR_BGR2BGRA)
    rgba[..., 3] = 128
    deep = (draw_rects((48, 64), [RECT]).astype(np.uint16) * 257)
    png = _png(draw_rects((48, 64), [RECT]))
    return {
        "good.jpg": (good, GOOD_ROW, None, ""),
        "corrupt.jpg": (b"\x00garbage" * 50, GOOD_ROW, "excluded", "not a recognised image"),
        "truncated.jpg": (good[: len(good) // 2], GOOD_ROW, "excluded", "runcated"),
        "truncated.png": (png[: len(png) // 2], GOOD_ROW, "excluded", "corrupt"),
        "empty.jpg": (b"", GOOD_ROW, "excluded", "not a recognised image"),
        "no_label.jpg": (good, None, "background", "no label file"),
        "empty_label.jpg": (good, "", "background", "empty label file"),
        "bad_class.jpg": (good, GOOD_ROW + "2 0.5 0.5 0.1 0.1\n-1 0.5 0.5 0.1 0.1\n"
                                     "0.5 0.5 0.5 0.1 0.1\n",
                          "fixed", "3 row(s) with class id outside 0..1 (-1, 0.5, 2) dropped"),
        "outside.jpg": (good, "0 0.1 0.5 0.22 0.5\n", "fixed", "1 row(s) outside [0, 1] clipped (row 1)"),
        "polygon_outside.jpg": (good, GOOD_ROW + "1 0.1 0.1 1.4 0.2 0.5 0.6\n", "fixed",
                                "1 row(s) outside [0, 1] clipped (row 2)"),
        "polygon_odd.jpg": (good, GOOD_ROW + "1 0.1 0.1 0.4 0.2 0.5\n1 0.1 0.1 0.4 0.2 0.5 0.6\n", "fixed",
                            "1 malformed row(s) dropped (row 2: 5 values after the class, neither a box (4) nor "
                            "a polygon (x y pairs, 3 points or more))"),
        "degenerate.jpg": (good, GOOD_ROW + "1 0.5 0.5 0 0.2\n1 0.5 0.5 0.01 0.2\n", "fixed",
                           "2 degenerate box(es) under 1 px dropped"),
        "nan.jpg": (good, GOOD_ROW + "1 nan 0.5 0.1 0.1\n", "fixed",
                    "1 row(s) with NaN/inf dropped"),
        "negative.jpg": (good, GOOD_ROW + "1 0.5 0.5 -0.1 0.1\n", "fixed",
                         "1 row(s) with negative size dropped"),
        "duplicate.jpg": (good, GOOD_ROW * 3, "fixed", "2 duplicate row(s) removed"),
        "malformed.jpg": (good, GOOD_ROW + "1 0.5 0.5\nhello world 1 2 3\n", "fixed",
                          "2 malformed row(s) dropped (row 2: 2 values after the class, neither a box (4) nor a "
                          "polygon (x y pairs, 3 points or more); row 3: not numbers)"),
        "binary_label.jpg": (good, None, "excluded", "label file unreadable"),
        "gray.png": (_png(gray), GOOD_ROW, None, ""),
        "rgba.png": (_png(rgba), GOOD_ROW, None, ""),
        "deep16.png": (_png(deep), GOOD_ROW, None, ""),
        "exif.jpg": (exif_bytes, exif_label, None, ""),
        "notes.gif": (b"GIF89a", None, "excluded", "unsupported file type"),
    }


@pytest.fixture()
def bad_yaml(tmp_path) -> Path:
    cases = _cases()
    yaml = write_yolo_dataset(tmp_path / "ds", {k: (v[0], v[1]) for k, v in cases.items()})
    (tmp_path / "ds" / "labels" / "train" / "binary_label.txt").write_bytes(b"\xff\xfe\x00\x81")
    (tmp_path / "ds" / "images" / "train" / "dangling.jpg").symlink_to(tmp_path / "nowhere.jpg")
    return yaml


def test_each_bad_file_reported_once_with_its_reason(bad_yaml, caplog):
    caplog.set_level(logging.INFO, logger="yolokit.data")
    index = yolo_index(bad_yaml, "train")
    problems = {Path(p.path).name: p for p in index.problems}
    expected = {k: (v[2], v[3]) for k, v in _cases().items() if v[2] is not None}
    expected["dangling.jpg"] = ("excluded", "file not found")
    assert set(problems) == set(expected)
    for name, (action, fragment) in expected.items():
        assert problems[name].action == action, name
        assert fragment in problems[name].reason, (name, problems[name].reason)
    # reported once each in the log, plus one summary line with the counts
    messages = [r.getMessage() for r in caplog.records]
    for name in expected:
        assert sum(f"/{name}:" in m for m in messages) == 1, name
    summary = [m for m in messages if "images excluded" in m]
    assert len(summary) == 1
    assert "16 images, " in summary[0]
    assert "2 backgrounds, 9 label files fixed, 7 images excluded" in summary[0]
    # nothing silently dropped: every file is either used or reported
    listed = {p.name for p in (bad_yaml.parent / "images" / "train").iterdir()}
    used = {Path(p).name for p in index.paths}
    excluded = {n for n, p in problems.items() if p.action == "excluded"}
    assert used | excluded == listed and not used & excluded


def test_fixed_labels_are_what_remains(bad_yaml):
    index = yolo_index(bad_yaml, "train")
    labels = {Path(p).name: lab for p, lab in zip(index.paths, index.labels, strict=True)}
    for name in ("good.jpg", "bad_class.jpg", "degenerate.jpg", "nan.jpg", "negative.jpg",
                 "duplicate.jpg", "malformed.jpg", "gray.png", "rgba.png", "deep16.png"):
        np.testing.assert_allclose(labels[name], [[0, *RECT]], atol=1e-3, err_msg=name)
    np.testing.assert_allclose(labels["outside.jpg"], [[0, 0, 12, 0.21 * 64, 36]], atol=1e-3)
    assert labels["no_label.jpg"].shape == (0, 5) and labels["empty_label.jpg"].shape == (0, 5)


def test_odd_images_load_upright_8bit_with_boxes_on_pixels(bad_yaml):
    ds = DetectionDataset(bad_yaml, "train", imgsz=64)
    by_name = {Path(p).name: i for i, p in enumerate(ds.index.paths)}
    for name in ("good.jpg", "gray.png", "rgba.png", "deep16.png", "exif.jpg"):
        item = ds[by_name[name]]
        image = item["image"].numpy().transpose(1, 2, 0)[..., ::-1]  # back to BGR HWC
        assert item["image"].dtype.is_floating_point is False and image.shape == (64, 64, 3)
        (box,) = item["boxes"].numpy()
        if name == "gray.png":  # red became grey level 76 (black 0, padding 114)
            ys, xs = np.nonzero((np.abs(image.astype(int) - 76) < 15).all(-1))
            extent = np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1])
        else:
            extent = colour_extent(image, 0)
        np.testing.assert_allclose(box, extent, atol=1.0, err_msg=name)
    assert ds[by_name["exif.jpg"]]["orig_shape"] == (64, 48)  # displayed, not stored, size
    assert ds[by_name["deep16.png"]]["image"].max() == 255


def test_whole_epoch_runs_without_crashing(bad_yaml):
    ds = DetectionDataset(bad_yaml, "train", imgsz=64, augment=True)
    loader = build_dataloader(ds, 4, workers=0, seed=0)
    seen = sum(len(b["paths"]) for b in loader)
    assert seen == len(ds) == 16


def test_image_broken_after_indexing_is_replaced_and_reported(bad_yaml, caplog):
    ds = DetectionDataset(bad_yaml, "train", imgsz=64)
    i = [Path(p).name for p in ds.index.paths].index("good.jpg")
    Path(ds.index.paths[i]).write_bytes(b"not an image any more")
    caplog.set_level(logging.WARNING, logger="yolokit.data")
    items = [ds[i] for _ in range(3)]
    assert all(it["index"] != i and it["path"] != ds.index.paths[i] for it in items)
    warned = [r for r in caplog.records if "good.jpg" in r.getMessage()]
    assert len(warned) == 1 and "excluded at run time" in warned[0].getMessage()


def test_split_without_usable_images_names_the_path(tmp_path):
    yaml = write_yolo_dataset(tmp_path / "bad", {"x.jpg": (b"junk", GOOD_ROW),
                                                "y.jpg": (b"", None)})
    with pytest.raises(DatasetError, match=str(tmp_path / "bad")):
        DetectionDataset(yaml, "train")
    empty = write_yolo_dataset(tmp_path / "none", {})
    with pytest.raises(DatasetError, match="no images found"):
        DetectionDataset(empty, "train")
