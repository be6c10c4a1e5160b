"""The built-in shapes set: deterministic, cached, atomic, a normal YOLO dataset."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import cv2
import numpy as np
import pytest
import yaml

import yolokit.data.sources.shapes as shapes_mod
from yolokit.data import SHAPE_NAMES, make_shapes
from yolokit.data.sources.readers import label_path, read_data_yaml


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.suffix in (".jpg", ".txt"):
            h.update(p.relative_to(folder).as_posix().encode() + p.read_bytes())
    return h.hexdigest()


def _labels(folder: Path, split: str) -> list[np.ndarray]:
    out = []
    for p in sorted((folder / "labels" / split).glob("*.txt")):
        rows = [list(map(float, line.split())) for line in p.read_text().splitlines() if line]
        out.append(np.array(rows, np.float64).reshape(-1, 5))
    return out


def test_layout_and_yaml(shapes_yaml):
    root = shapes_yaml.parent
    cfg = yaml.safe_load(shapes_yaml.read_text())
    assert cfg["train"] == "images/train" and cfg["val"] == "images/val"
    assert Path(cfg["path"]) == root
    assert read_data_yaml(shapes_yaml)["names"] == list(SHAPE_NAMES)
    images = sorted((root / "images" / "train").glob("*.jpg"))
    assert len(images) == 24 and len(list((root / "images" / "val").glob("*.jpg"))) == 12
    for p in images:  # every image has its label file by the images/ -> labels/ rule
        assert Path(label_path(p)).is_file()
        h, w = cv2.imread(str(p)).shape[:2]
        assert max(h, w) == 128


def test_content_variety(tmp_path):
    root = make_shapes(tmp_path / "s", seed=3, n_train=150, n_val=2, imgsz=160).parent
    labels = _labels(root, "train")
    rows = np.concatenate(labels)
    assert set(rows[:, 0].astype(int)) == {0, 1, 2, 3}
    assert (rows[:, 1:] >= 0).all() and (rows[:, 1:] <= 1).all()
    assert (rows[:, 1:3] - rows[:, 3:5] / 2 >= -1e-5).all()  # boxes inside the image
    sizes = np.sqrt(rows[:, 3] * rows[:, 4])
    assert sizes.min() < 0.06 and sizes.max() > 0.4  # tiny to large
    n_boxes = np.array([len(x) for x in labels])
    assert 1 <= (n_boxes == 0).sum() <= 30  # some images without objects
    assert n_boxes.max() >= 5
    overlaps = 0
    for x in labels:
        b = np.c_[x[:, 1] - x[:, 3] / 2, x[:, 2] - x[:, 4] / 2, x[:, 1] + x[:, 3] / 2,
                  x[:, 2] + x[:, 4] / 2]
        for i in range(len(b)):
            for j in range(i + 1, len(b)):
                iw = min(b[i, 2], b[j, 2]) - max(b[i, 0], b[j, 0])
                ih = min(b[i, 3], b[j, 3]) - max(b[i, 1], b[j, 1])
                overlaps += iw > 0 and ih > 0
    assert overlaps >= 5
    shapes = {cv2.imread(str(p)).shape[:2] for p in (root / "images" / "train").glob("*.jpg")}
    assert len(shapes) >= 3  # several aspect ratios


def test_deterministic_from_seed(tmp_path, shapes_yaml):
    again = make_shapes(tmp_path / "again", seed=0, n_train=24, n_val=12, imgsz=128)
    assert _digest(again.parent) == _digest(shapes_yaml.parent)
    other = make_shapes(tmp_path / "other", seed=1, n_train=24, n_val=12, imgsz=128)
    assert _digest(other.parent) != _digest(shapes_yaml.parent)


def test_default_cache_folder_and_reuse(tmp_path, monkeypatch):
    monkeypatch.setenv("YOLOKIT_CACHE", str(tmp_path / "cache"))
    first = make_shapes(n_train=4, n_val=2, imgsz=64)
    assert first.parent.parent == tmp_path / "cache" and first.parent.name.startswith("shapes-")
    stamp = os.stat(first).st_mtime_ns
    calls = []
    monkeypatch.setattr(shapes_mod, "_write_dataset", lambda *a: calls.append(a))
    assert make_shapes(n_train=4, n_val=2, imgsz=64) == first  # reused, not rewritten
    assert calls == [] and os.stat(first).st_mtime_ns == stamp
    # other parameters -> another folder
    monkeypatch.undo()
    monkeypatch.setenv("YOLOKIT_CACHE", str(tmp_path / "cache"))
    assert make_shapes(n_train=4, n_val=2, imgsz=64, seed=9) != first


def test_interrupted_generation_leaves_nothing(tmp_path, monkeypatch):
    real = shapes_mod._write_image
    count = []

    def dies_midway(*args):
        count.append(1)
        if len(count) == 3:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(shapes_mod, "_write_image", dies_midway)
    target = tmp_path / "set"
    with pytest.raises(KeyboardInterrupt):
        make_shapes(target, n_train=6, n_val=2, imgsz=64)
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []  # no temporary folder left either
    monkeypatch.setattr(shapes_mod, "_write_image", real)
    assert make_shapes(target, n_train=6, n_val=2, imgsz=64).is_file()


def test_refuses_foreign_folder(tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "mine.txt").write_text("x")
    with pytest.raises(FileExistsError):
        make_shapes(tmp_path / "busy", n_train=2, n_val=1, imgsz=64)


def test_labels_are_tight_around_the_drawn_shape(monkeypatch):
    """On a flat background with a white shape, the label equals the shape's pixel extent."""
    monkeypatch.setattr(shapes_mod, "_background",
                        lambda rng, h, w: np.zeros((h, w, 3), np.uint8))
    monkeypatch.setattr(shapes_mod, "_colour", lambda rng, avoid: (255, 255, 255))
    seen = set()
    for seed in range(40):
        image, labels = shapes_mod.draw_shapes_image(np.random.default_rng(seed), imgsz=96,
                                                     max_objects=1, background_fraction=0)
        assert len(labels) <= 1
        if not labels:
            continue
        c, *box = labels[0]
        ys, xs = np.nonzero(image.max(-1) > 128)
        extent = [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]
        np.testing.assert_allclose(box, extent, atol=1.0, err_msg=f"class {c}")
        seen.add(c)
    assert seen == {0, 1, 2, 3}
