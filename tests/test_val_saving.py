"""`yolokit val --save-json / --save-txt`: COCO results pycocotools reads against the same json, and
YOLO label files, holding exactly the detections validation scored."""

import contextlib
import csv
import io
import json
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

import yolokit.cli
import yolokit.val.loop
from yolokit.cli import main
from yolokit.data import DetectionDataset, make_shapes
from yolokit.ops.nms import Detections

# A COCO json with non-contiguous ids: categories 3 (cat, class 0) and 7 (dog, class 1), images
# 101, 205 and 300 (a background image). Each image has its own shape, which is how the scripted
# model below knows which image it is looking at.
IMAGES = [(101, "a.png", 64, 80), (205, "b.png", 48, 96), (300, "c.png", 72, 72)]
ANNOTATIONS = [(101, 3, [10, 10, 30, 30]), (101, 7, [45, 20, 25, 35]), (205, 3, [5, 5, 40, 30]),
               (205, 3, [60, 10, 20, 20])]
# per (h, w): xyxy boxes in original pixels, scores, class indices: hits, a shifted hit, wrong
# classes, a missed box (205's second cat) and a false positive on the background image
SCRIPT = {
    (64, 80): ([[10, 10, 40, 40], [47, 22, 70, 55], [45, 20, 70, 55]], [0.9, 0.8, 0.3], [0, 1, 0]),
    (48, 96): ([[6, 5, 45, 37], [60, 10, 80, 30]], [0.7, 0.6], [0, 1]),
    (72, 72): ([[0, 0, 30, 30]], [0.5], [1]),
}


class ScriptedDetector(torch.nn.Module):
    """Stands in for a Detector: the detections of each image are SCRIPT's for its original shape."""

    strides = (8, 16, 32)
    num_classes = 2
    has_names = False
    names = ["0", "1"]

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def predict(self, images, *, orig_shapes, **kwargs):
        out = []
        for h, w in orig_shapes:
            boxes, scores, labels = SCRIPT[(int(h), int(w))]
            out.append(Detections(torch.tensor(boxes, dtype=torch.float32), torch.tensor(scores),
                                  torch.tensor(labels)))
        return out


def write_coco(root):
    root.mkdir()
    for _, name, h, w in IMAGES:
        assert cv2.imwrite(str(root / name), np.full((h, w, 3), 90, np.uint8))
    data = {"images": [{"id": i, "file_name": name, "height": h, "width": w} for i, name, h, w in IMAGES],
            "categories": [{"id": 3, "name": "cat"}, {"id": 7, "name": "dog"}],
            "annotations": [{"id": k + 1, "image_id": i, "category_id": c, "bbox": b, "area": b[2] * b[3],
                             "iscrowd": 0} for k, (i, c, b) in enumerate(ANNOTATIONS)]}
    path = root / "instances.json"
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def scored(monkeypatch):
    """Every (predictions, EvalResult) validation scores in this test."""
    calls, real = [], yolokit.val.loop.coco_evaluate

    def spy(predictions, *args, **kwargs):
        result = real(predictions, *args, **kwargs)
        calls.append((list(predictions), result))
        return result

    monkeypatch.setattr(yolokit.val.loop, "coco_evaluate", spy)
    return calls


def test_save_json_on_a_coco_json_is_read_by_pycocotools_against_it(tmp_path, monkeypatch, capsys, scored):
    COCO = pytest.importorskip("pycocotools.coco").COCO   # not on every machine (the GPU image)
    COCOeval = pytest.importorskip("pycocotools.cocoeval").COCOeval
    ann = write_coco(tmp_path / "coco")
    monkeypatch.setattr(yolokit.cli, "_inference_model", lambda args: ScriptedDetector())
    out = tmp_path / "val"
    # max_det stays 300: yolokit's COCO evaluator, as COCOeval, ranks at most 100 per (image, class)
    assert main(["val", "--data", str(ann), "--imgsz", "64", "--batch", "2", "--workers", "0", "--no-plots",
                 "--save-json", "--out", str(out)]) == 0
    assert f"COCO results written to {out / 'predictions.json'}" in capsys.readouterr().out
    assert not (out / "labels").exists()
    (predictions, result), = scored
    assert sum(len(d) for d in predictions) == 6
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(ann))
        dt = gt.loadRes(str(out / "predictions.json"))
    records = dt.loadAnns(dt.getAnnIds())
    assert len(records) == 6
    assert {r["image_id"] for r in records} == {101, 205, 300}   # the json's ids, every image predicted on
    assert {r["category_id"] for r in records} == {3, 7}         # the json's ids, not the class indices
    first = next(r for r in records if r["score"] == pytest.approx(0.9))
    assert (first["image_id"], first["category_id"], first["bbox"]) == (101, 3, [10, 10, 30, 30])  # x, y, w, h
    wrong = next(r for r in records if r["score"] == pytest.approx(0.3))
    assert (wrong["image_id"], wrong["category_id"], wrong["bbox"]) == (101, 3, [45, 20, 25, 35])
    with contextlib.redirect_stdout(io.StringIO()):
        ev = COCOeval(gt, dt, "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    assert 0 < ev.stats[0] < ev.stats[1] < 1   # a score the file decides, not 0 or 1
    np.testing.assert_allclose(result.stats, ev.stats, rtol=1e-9, atol=1e-12)  # same 12 numbers
    row = next(csv.DictReader((out / "per_class.csv").open()))   # what `yolokit val` wrote for "all"
    assert float(row["mAP50-95"]) == pytest.approx(ev.stats[0], rel=1e-5)
    assert float(row["mAP50"]) == pytest.approx(ev.stats[1], rel=1e-5)


def test_save_txt_with_scores_on_a_yolo_set_holds_each_images_detections(tmp_path, capsys, scored):
    data = make_shapes(tmp_path / "shapes", n_train=1, n_val=3, imgsz=64)
    out = tmp_path / "val"
    torch.manual_seed(0)   # an untrained yolov8n, whose low scores still give boxes at conf 0.001
    assert main(["val", "--data", str(data), "--model", "yolov8n", "--num-classes", "4", "--imgsz", "64",
                 "--max-det", "5", "--workers", "0", "--device", "cpu", "--no-plots", "--save-txt", "--save-conf",
                 "--save-json", "--out", str(out)]) == 0
    assert f"YOLO label files with scores written to {out / 'labels'}" in capsys.readouterr().out
    (predictions, _), = scored                         # in dataset order
    dataset = DetectionDataset(data, "val")
    stems = [Path(p).stem for p in dataset.index.paths]
    assert len(predictions) == len(stems) == 3 and sum(len(d) for d in predictions) > 0
    assert sorted(p.name for p in (out / "labels").iterdir()) == sorted(f"{s}.txt" for s in stems)
    records = json.loads((out / "predictions.json").read_text())
    assert len(records) == sum(len(d) for d in predictions)
    for stem, (h, w), det in zip(stems, dataset.shapes, predictions, strict=True):
        lines = [line.split() for line in (out / "labels" / f"{stem}.txt").read_text().splitlines()]
        assert len(lines) == len(det)
        boxes = det.boxes.numpy()
        expected = np.stack([(boxes[:, 0] + boxes[:, 2]) / 2 / w, (boxes[:, 1] + boxes[:, 3]) / 2 / h,
                             (boxes[:, 2] - boxes[:, 0]) / w, (boxes[:, 3] - boxes[:, 1]) / h], 1)
        assert [int(line[0]) for line in lines] == det.labels.tolist()
        np.testing.assert_allclose([[float(v) for v in line[1:5]] for line in lines], expected, atol=1e-6)
        np.testing.assert_allclose([float(line[5]) for line in lines], det.scores.numpy(), rtol=1e-5)
        mine = [r for r in records if r["image_id"] == stem]   # YOLO sets: the stem, the class index
        assert len(mine) == len(det) and [r["category_id"] for r in mine] == det.labels.tolist()


def test_without_the_flags_val_writes_neither(tmp_path, monkeypatch, capsys):
    ann = write_coco(tmp_path / "coco")
    monkeypatch.setattr(yolokit.cli, "_inference_model", lambda args: ScriptedDetector())
    out = tmp_path / "val"
    assert main(["val", "--data", str(ann), "--imgsz", "64", "--workers", "0", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "COCO results" not in printed and "label files" not in printed
    assert (out / "per_class.csv").is_file() and (out / "pr_curve.png").is_file()
    assert not (out / "predictions.json").exists() and not (out / "labels").exists()
