"""Sources: data.yaml forms, the images/ -> labels/ rule, COCO json, YOLO == COCO."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from yolokit.data import DatasetError, DetectionDataset
from yolokit.data.sources.readers import coco_index, label_path, load_split, read_data_yaml, yolo_index

from .conftest import draw_rects


def test_label_path_rule():
    sep = os.sep
    assert (label_path(f"{sep}d{sep}images{sep}train{sep}a.jpg")
            == f"{sep}d{sep}labels{sep}train{sep}a.txt")
    # only the last /images/ component is replaced
    assert (label_path(f"{sep}images{sep}x{sep}images{sep}b.PNG")
            == f"{sep}images{sep}x{sep}labels{sep}b.txt")
    assert label_path(f"{sep}flat{sep}c.jpeg") == f"{sep}flat{sep}c.txt"
    assert label_path(f"{sep}d{sep}myimages{sep}e.jpg") == f"{sep}d{sep}myimages{sep}e.txt"


def test_names_as_list_dict_or_nc(tmp_path):
    y = tmp_path / "a.yaml"
    y.write_text("path: .\ntrain: images\nnames: {0: cat, 2: dog}\n")
    assert read_data_yaml(y)["names"] == ["cat", "1", "dog"]
    y.write_text("train: images\nnames: [cat, dog]\n")
    cfg = read_data_yaml(y)
    assert cfg["names"] == ["cat", "dog"] and cfg["path"] == tmp_path.resolve()
    y.write_text("train: images\nnc: 3\n")
    assert read_data_yaml(y)["names"] == ["0", "1", "2"]
    y.write_text("train: images\n")
    with pytest.raises(DatasetError):
        read_data_yaml(y)


def _ultralytics_style(root: Path) -> Path:
    """coco8-like: relative path, dict names, image folders and a .txt image list."""
    rng = np.random.default_rng(0)
    for split, n in (("train", 3), ("val", 2)):
        (root / "images" / split).mkdir(parents=True)
        (root / "labels" / split).mkdir(parents=True)
        for i in range(n):
            img = (rng.random((48, 64, 3)) * 255).astype(np.uint8)
            import cv2
            cv2.imwrite(str(root / "images" / split / f"{i}.jpg"), img)
            (root / "labels" / split / f"{i}.txt").write_text(f"{i % 2} 0.5 0.5 0.25 0.5\n")
    (root / "train.txt").write_text("./images/train/0.jpg\n./images/train/2.jpg\n")
    yaml = root / "data.yaml"
    yaml.write_text("path: ../ds  # dataset root dir\ntrain: images/train\nval: images/val\n"
                    "test:  # optional\nnames:\n  0: person\n  1: bicycle\n"
                    "download: https://example.invalid/never-fetched.zip\n")
    return yaml


def test_ultralytics_folder_loads_unchanged(tmp_path):
    yaml = _ultralytics_style(tmp_path / "ds")
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "ds").rglob("*"))
    train = yolo_index(yaml, "train")
    assert len(train) == 3 and train.names == ["person", "bicycle"]
    assert [Path(p).name for p in train.paths] == ["0.jpg", "1.jpg", "2.jpg"]
    np.testing.assert_allclose(train.labels[1], [[1, 24, 12, 40, 36]])  # 64x48 pixels
    assert train.shapes.tolist() == [[48, 64]] * 3
    assert len(yolo_index(yaml, "val")) == 2
    with pytest.raises(DatasetError, match="test"):
        yolo_index(yaml, "test")
    after = sorted(p.relative_to(tmp_path) for p in (tmp_path / "ds").rglob("*"))
    assert set(after) - set(before) == {Path("ds/labels/train.yolokit.cache"),
                                         Path("ds/labels/val.yolokit.cache")}


def test_split_as_txt_list_or_list_of_folders(tmp_path):
    yaml = _ultralytics_style(tmp_path / "ds")
    yaml.write_text("path: .\ntrain: train.txt\nval: [images/train, images/val]\nnames: [a, b]\n")
    assert [Path(p).name for p in yolo_index(yaml, "train").paths] == ["0.jpg", "2.jpg"]
    assert len(yolo_index(yaml, "val")) == 5
    yaml.write_text("path: .\ntrain: nowhere\nnames: [a, b]\n")
    with pytest.raises(DatasetError, match="nowhere"):
        yolo_index(yaml, "train")


def test_dataset_dir_with_data_yaml_and_shapes_keyword(tmp_path, shapes_yaml, monkeypatch):
    assert len(load_split(shapes_yaml.parent, "val")) == 12
    import yolokit.data.sources.shapes as shapes_mod
    monkeypatch.setattr(shapes_mod, "make_shapes", lambda: shapes_yaml)
    assert len(load_split("shapes", "val")) == 12


def _coco_from_yolo(yaml: Path, split: str, out: Path, cat_ids=(3, 5, 9, 11)) -> Path:
    """Write a COCO json with the same boxes as a YOLO split (plus a crowd box)."""
    index = yolo_index(yaml, split)
    root = Path(index.paths[0]).parent
    images, anns = [], []
    for i, (p, (h, w), lab) in enumerate(zip(index.paths, index.shapes, index.labels, strict=True)):
        images.append({"id": 100 + i, "file_name": Path(p).name, "height": int(h), "width": int(w)})
        for c, x1, y1, x2, y2 in lab.tolist():
            anns.append({"id": len(anns) + 1, "image_id": 100 + i, "category_id": cat_ids[int(c)],
                         "bbox": [x1, y1, x2 - x1, y2 - y1], "area": (x2 - x1) * (y2 - y1),
                         "iscrowd": 0})
        anns.append({"id": len(anns) + 1, "image_id": 100 + i, "category_id": cat_ids[0],
                     "bbox": [1, 1, 20, 20], "area": 400, "iscrowd": 1})
    cats = [{"id": c, "name": n} for c, n in zip(cat_ids, index.names, strict=True)][::-1]  # unsorted
    out.write_text(json.dumps({"images": images, "annotations": anns, "categories": cats}))
    return root


def test_coco_and_yolo_give_the_same_targets(tmp_path, shapes_yaml):
    json_path = tmp_path / "instances_val.json"
    image_dir = _coco_from_yolo(shapes_yaml, "val", json_path)
    yolo = DetectionDataset(shapes_yaml, "val", imgsz=96)
    coco = DetectionDataset(json_path, imgsz=96, image_dir=image_dir)
    assert coco.names == yolo.names
    assert coco.category_ids == [3, 5, 9, 11]
    assert coco.image_ids == [100 + i for i in range(12)]
    assert len(coco) == len(yolo) == 12
    n_boxes = 0
    for i in range(len(yolo)):
        a, b = yolo[i], coco[i]
        assert a["path"] == b["path"] and a["orig_shape"] == b["orig_shape"]
        assert a["ratio_pad"] == b["ratio_pad"]
        assert a["classes"].tolist() == b["classes"].tolist()  # crowd boxes left out
        np.testing.assert_allclose(a["boxes"].numpy(), b["boxes"].numpy(), atol=1e-3)
        assert (a["image"] == b["image"]).all()
        n_boxes += len(a["boxes"])
    assert n_boxes > 10


def test_coco_image_dir_is_guessed_and_problems_reported(tmp_path):
    import cv2
    root = tmp_path / "coco"
    (root / "annotations").mkdir(parents=True)
    (root / "images" / "val2017").mkdir(parents=True)
    for name in ("a.jpg", "b.jpg"):
        cv2.imwrite(str(root / "images" / "val2017" / name), draw_rects((40, 60), [(5, 5, 20, 20)]))
    data = {
        "images": [{"id": 1, "file_name": "a.jpg", "height": 40, "width": 60},
                   {"id": 2, "file_name": "b.jpg", "height": 20, "width": 30},  # wrong size
                   {"id": 3, "file_name": "missing.jpg", "height": 40, "width": 60}],
        "annotations": [
            {"id": 1, "image_id": 1, "category_id": 7, "bbox": [5, 5, 15, 15], "iscrowd": 0},
            {"id": 2, "image_id": 1, "category_id": 7, "bbox": [50, 30, 20, 20], "iscrowd": 0},
            {"id": 3, "image_id": 1, "category_id": 99, "bbox": [1, 1, 5, 5], "iscrowd": 0},
            {"id": 4, "image_id": 2, "category_id": 7, "bbox": [2.5, 2.5, 7.5, 7.5], "iscrowd": 0},
        ],
        "categories": [{"id": 7, "name": "box"}],
    }
    (root / "annotations" / "instances_val2017.json").write_text(json.dumps(data))
    index = coco_index(root / "annotations" / "instances_val2017.json")
    assert [Path(p).name for p in index.paths] == ["a.jpg", "b.jpg"]
    np.testing.assert_allclose(index.labels[0], [[0, 5, 5, 20, 20], [0, 50, 30, 60, 40]])
    np.testing.assert_allclose(index.labels[1], [[0, 5, 5, 20, 20]])  # scaled x2 to the file
    reasons = {(Path(p.path).name, p.action): p.reason for p in index.problems}
    assert len(index.problems) == len(reasons) == 3  # one report per file
    assert "1 annotation(s) with unknown category_id dropped" in reasons[("a.jpg", "fixed")]
    assert "1 box(es) outside the image clipped" in reasons[("a.jpg", "fixed")]
    assert "differs" in reasons[("b.jpg", "fixed")]
    assert "not found" in reasons[("missing.jpg", "excluded")]
    shutil.rmtree(root / "images")
    with pytest.raises(DatasetError, match="instances_val2017"):
        coco_index(root / "annotations" / "instances_val2017.json", cache=False)


def test_segmentation_rows_become_their_bounding_box():
    from yolokit.data.sources.labels import parse_yolo_labels

    labels, fixes = parse_yolo_labels("1 0.1 0.2 0.5 0.2 0.3 0.6\n0 0.5 0.5 0.2 0.2\n",
                                      (100, 200), 2)
    assert fixes == []
    np.testing.assert_allclose(labels, [[1, 20, 20, 100, 60], [0, 80, 40, 120, 60]], atol=1e-4)


def test_polygon_rows_keep_their_points_aligned_with_their_rows_through_every_repair():
    """A set of rows mixing polygons and boxes, with a malformed row, a bad class, a duplicate and a degenerate
    polygon: the polygons left stay beside their own rows (a box row has none), clipped and in pixels."""
    from yolokit.data.sources.labels import parse_yolo_segments

    text = "\n".join([
        "1 0.1 0.2 0.5 0.2 0.3 0.6",           # triangle: box (20, 20, 100, 60)
        "0 0.5 0.5 0.2 0.2",                   # a box row: no polygon
        "7 0.1 0.1 0.2 0.1 0.2 0.2",           # class 7 of 2: dropped
        "1 0.1 0.2 0.5 0.2 0.3 0.6",           # the triangle again: a duplicate, dropped
        "0 0.9 0.9 1.2 0.9 1.1 1.3",           # points past the edge: clipped to (180..200, 90..100)
        "1 0.40 0.40 0.401 0.40 0.4005 0.401",  # under a pixel: dropped
        "0 0.3 0.3 0.4",                       # malformed
    ])
    labels, polygons, fixes = parse_yolo_segments(text, (100, 200), 2)
    assert labels[:, 0].tolist() == [1, 0, 0] and len(polygons) == 3 and polygons[1] is None
    np.testing.assert_allclose(polygons[0], [[20, 20], [100, 20], [60, 60]], rtol=1e-6)
    np.testing.assert_allclose(polygons[2], [[180, 90], [200, 90], [200, 100]], rtol=1e-6)
    np.testing.assert_allclose(labels[2, 1:], [180, 90, 200, 100], rtol=1e-6)
    assert all(p.dtype == np.float32 for p in (polygons[0], polygons[2]))
    assert len(fixes) == 5, fixes   # malformed, class, clipped, degenerate, duplicate


def test_a_segmentation_set_keeps_its_polygons_through_the_label_cache_and_the_selection(tmp_path, monkeypatch):
    """Polygon rows mixed with box rows (within a file and across files) and a file of boxes only: the index
    holds each row's polygon or None; the label cache gives the same back (a cache without polygons, from
    before, is rebuilt); a detection set has none at all; a fraction and a class filter keep them aligned."""
    import cv2

    from yolokit.data.sources.labels import CACHE_SUFFIX, load_index
    from yolokit.data.sources.selection import select

    root = tmp_path / "seg"
    rows = {"a": "0 0.1 0.1 0.5 0.1 0.3 0.5\n1 0.5 0.5 0.2 0.2\n", "b": "1 0.5 0.5 0.2 0.2\n",
            "c": "1 0.2 0.2 0.8 0.2 0.8 0.8 0.2 0.8\n0 0.6 0.1 0.9 0.1 0.9 0.3\n"}
    for split in ("train",):
        (root / "images" / split).mkdir(parents=True)
        (root / "labels" / split).mkdir(parents=True)
        for name, text in rows.items():
            cv2.imwrite(str(root / "images" / split / f"{name}.jpg"), np.zeros((40, 80, 3), np.uint8))
            (root / "labels" / split / f"{name}.txt").write_text(text)
    yaml = root / "data.yaml"
    yaml.write_text(f"path: {root}\ntrain: images/train\nval: images/train\nnames: [x, y]\n")
    from yolokit.data.sources import readers

    for attempt in ("built", "cached"):
        if attempt == "cached":                                   # from the cache file, not built again
            monkeypatch.setattr(readers, "_build_yolo", lambda *a: pytest.fail("built again"))
        index = yolo_index(yaml, "train")
        images = [index.segments.image(i) for i in range(len(index))]
        assert [len(r) for r in images] == [2, 1, 2], attempt
        assert images[0][1] is None and images[1] == [None]
        np.testing.assert_allclose(images[0][0], [[8, 4], [40, 4], [24, 20]], rtol=1e-6)
        np.testing.assert_allclose(images[2][1], [[48, 4], [72, 4], [72, 12]], rtol=1e-6)
        assert index.segments.points.dtype == np.float32 and index.segments.points.shape == (3 + 4 + 3, 2)
    cache = root / "labels" / f"train{CACHE_SUFFIX}"
    assert cache.is_file() and load_index(cache, "not its key") is None
    kept, _ = select(index, classes=[0])
    rows = [kept.segments.image(i) for i in range(3)]
    assert [len(r) for r in rows] == [1, 0, 1] and rows[2][0].shape == (3, 2)
    np.testing.assert_array_equal(rows[2][0], images[2][1])        # the class-0 triangle of image c, itself
    kept, _ = select(index, fraction=0.5, seed=0)
    assert len(kept.segments) == len(kept.labels) == 2
    assert [len(kept.segments.image(i)) for i in range(2)] == [len(lb) for lb in kept.labels]
    monkeypatch.undo()
    assert yolo_index(_ultralytics_style(tmp_path / "ds"), "train").segments is None


def test_check_files_keeps_the_order_in_one_thread_from_the_page_cache_and_overlaps_waits():
    import threading
    import time

    from yolokit.data.sources.readers import check_files

    def cpu(x):
        sum(range(2000))                                  # work that holds the GIL, no waiting
        return x, threading.get_ident()

    def slow(x):
        time.sleep(0.002)                                 # a storage wait: wall time, no CPU time
        return x, threading.get_ident()

    fast = check_files(cpu, range(300), chunk=16)        # (one thread, unless this machine is very busy)
    assert [x for x, _ in fast] == list(range(300))
    waited = check_files(slow, range(300), chunk=16)
    assert [x for x, _ in waited] == list(range(300))
    assert {t for _, t in waited[:16]} == {threading.get_ident()} and len({t for _, t in waited[16:]}) > 1
    assert check_files(cpu, [], chunk=16) == []
