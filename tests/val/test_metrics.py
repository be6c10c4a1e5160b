import contextlib
import csv
import dataclasses
import io
import json
import pickle

import numpy as np
import pytest
import torch

from yolokit.ops.nms import Detections
from yolokit.val import EvalResult, coco_evaluate


def handmade():
    """Three images, two classes: hits, a near miss, a false positive, a missed box, a class-1-only image."""
    targets = [
        (np.array([[10, 10, 50, 50], [60, 60, 90, 100]], float), np.array([0, 1])),
        (np.array([[0, 0, 30, 20]], float), np.array([0])),
        (np.array([[5, 5, 25, 45], [40, 40, 80, 70]], float), np.array([1, 1])),
    ]
    preds = [
        Detections(torch.tensor([[11.0, 9.0, 50.0, 52.0], [61.0, 58.0, 92.0, 99.0], [100.0, 0.0, 120.0, 20.0]]),
                   torch.tensor([0.9, 0.8, 0.3]), torch.tensor([0, 1, 0])),
        Detections(torch.tensor([[4.0, 2.0, 30.0, 20.0]]), torch.tensor([0.6]), torch.tensor([0])),
        Detections(torch.tensor([[5.0, 8.0, 25.0, 44.0]]), torch.tensor([0.7]), torch.tensor([1])),
    ]
    shapes = [(120, 130), (40, 40), (100, 100)]
    return preds, targets, shapes


def test_equals_pycocotools_run_directly(tmp_path):
    COCO = pytest.importorskip("pycocotools.coco").COCO   # not on every machine (the GPU image)
    COCOeval = pytest.importorskip("pycocotools.cocoeval").COCOeval
    preds, targets, shapes = handmade()
    result = coco_evaluate(preds, targets, shapes, num_classes=2)
    # the same case written as COCO files, category ids 7 and 9, image ids 100+
    cat = {0: 7, 1: 9}
    gt = {"images": [{"id": 100 + i, "height": h, "width": w} for i, (h, w) in enumerate(shapes)],
          "categories": [{"id": 7, "name": "a"}, {"id": 9, "name": "b"}], "annotations": []}
    for i, (boxes, labels) in enumerate(targets):
        for b, label in zip(boxes, labels, strict=True):
            gt["annotations"].append({"id": len(gt["annotations"]) + 1, "image_id": 100 + i,
                                      "category_id": cat[int(label)],
                                      "bbox": [b[0], b[1], b[2] - b[0], b[3] - b[1]],
                                      "area": (b[2] - b[0]) * (b[3] - b[1]), "iscrowd": 0})
    dets = [{"image_id": 100 + i, "category_id": cat[int(label)], "score": float(s),
             "bbox": [float(b[0]), float(b[1]), float(b[2] - b[0]), float(b[3] - b[1])]}
            for i, d in enumerate(preds) for b, s, label in zip(d.boxes, d.scores, d.labels, strict=True)]
    (tmp_path / "gt.json").write_text(json.dumps(gt))
    (tmp_path / "dt.json").write_text(json.dumps(dets))
    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO(str(tmp_path / "gt.json"))
        ev = COCOeval(coco, coco.loadRes(str(tmp_path / "dt.json")), "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    np.testing.assert_allclose(result.stats, ev.stats)
    assert result.map50_95 == pytest.approx(ev.stats[0]) and result.map50 == pytest.approx(ev.stats[1])
    precision = ev.eval["precision"][:, :, :, 0, -1]
    for k in range(2):
        p = precision[:, :, k]
        assert result.per_class_ap[k] == pytest.approx(p[p > -1].mean())
    assert 0 < result.map50_95 < result.map50 <= 1


def test_perfect_predictions_score_one_and_absent_class_is_nan():
    targets = [(np.array([[0, 0, 10, 10], [20, 20, 40, 50]], float), np.array([0, 0]))]
    preds = [Detections(torch.tensor([[0.0, 0.0, 10.0, 10.0], [20.0, 20.0, 40.0, 50.0]]), torch.tensor([0.9, 0.8]),
                        torch.tensor([0, 0]))]
    result = coco_evaluate(preds, targets, [(60, 60)], num_classes=3)
    assert result.map50_95 == pytest.approx(1.0) and result.map50 == pytest.approx(1.0)
    assert result.precision == pytest.approx(1.0) and result.recall == pytest.approx(1.0)
    assert result.per_class_ap[0] == pytest.approx(1.0) and np.isnan(result.per_class_ap[1:]).all()


def test_no_detections_gives_zeros():
    targets = [(np.array([[0, 0, 10, 10]], float), np.array([0]))]
    empty = Detections(torch.zeros(0, 4), torch.zeros(0), torch.zeros(0, dtype=torch.long))
    result = coco_evaluate([empty], targets, [(20, 20)], num_classes=1)
    assert result.map50 == 0 and result.map50_95 == 0
    with pytest.raises(ValueError, match="predictions"):
        coco_evaluate([empty, empty], targets, [(20, 20)], num_classes=1)


def confusion_case():
    """Image 1: a hit, a wrong class on a box, a false positive, a low score; image 2: a miss."""
    targets = [(np.array([[0, 0, 20, 20], [40, 40, 60, 60]], float), np.array([0, 1])),
               (np.array([[5, 5, 25, 25]], float), np.array([1]))]
    preds = [Detections(torch.tensor([[0.0, 0, 20, 20], [40, 41, 60, 60], [80, 80, 90, 90], [0, 0, 20, 19]]),
                        torch.tensor([0.9, 0.6, 0.5, 0.1]), torch.tensor([0, 0, 1, 1])),
             Detections(torch.zeros(0, 4), torch.zeros(0), torch.zeros(0, dtype=torch.long))]
    return preds, targets, [(100, 100), (30, 30)]


def test_confusion_matrix_counts_hits_confusions_misses_and_false_positives():
    preds, targets, shapes = confusion_case()
    result = coco_evaluate(preds, targets, shapes, num_classes=2)
    np.testing.assert_array_equal(result.confusion, [[1, 1, 0], [0, 0, 1], [0, 1, 0]])
    assert result.class_images.tolist() == [1, 2] and result.class_instances.tolist() == [1, 2]


def test_precision_recall_at_the_best_f1_confidence():
    preds, targets, shapes = handmade()
    result = coco_evaluate(preds, targets, shapes, num_classes=2)
    # class 0: 2 boxes, hits at 0.9 and 0.6, a false positive at 0.3; class 1: 3 boxes, hits at 0.8 and 0.7.
    # Curves interpolate linearly between detections' scores. The mean F1 peaks at 0.6 (class 0 P = R = 1,
    # class 1 F1 0.8) and falls faster to the right, so the smoothed best sits a little below 0.6.
    assert 0.5 < result.best_conf <= 0.6
    assert result.per_class_recall.tolist() == pytest.approx([1.0, 2 / 3])
    p0 = 2 / 3 + (result.best_conf - 0.3) / 0.3 / 3  # class 0 precision between its 0.3 and 0.6 detections
    assert result.per_class_precision.tolist() == pytest.approx([p0, 1.0], abs=1e-3)
    assert (result.precision, result.recall) == pytest.approx(((p0 + 1) / 2, (1 + 2 / 3) / 2), abs=1e-3)
    k = int(np.argmin(np.abs(result.conf_points - 0.45)))
    assert result.conf_f1[1, k] == pytest.approx(0.8) and result.conf_recall[0, 0] == pytest.approx(1.0)
    assert result.conf_precision[0, 0] == pytest.approx(2 / 3)  # at conf 0 every detection counts
    assert (result.conf_precision[:, -1] == 1).all() and (result.conf_recall[:, -1] == 0).all()
    assert result.per_class_ap50.tolist() == pytest.approx([1.0, 67 / 101])  # COCO's 101 recall points


def test_table_csv_and_text(tmp_path):
    preds, targets, shapes = handmade()
    result = coco_evaluate(preds, targets, shapes, num_classes=3)  # class 2 has no ground truth: no row
    rows = result.table(["cat", "dog", "emu"])
    assert [r["class"] for r in rows] == ["all", "cat", "dog"]
    assert (rows[0]["images"], rows[0]["instances"]) == (3, 5) and (rows[2]["images"], rows[2]["instances"]) == (2, 3)
    assert rows[1]["mAP50-95"] == pytest.approx(result.per_class_ap[0])
    text = result.format_table(["cat", "dog", "emu"]).splitlines()
    assert text[0].split() == ["Class", "Images", "Instances", "P", "R", "mAP50", "mAP50-95"]
    assert text[1].split()[:3] == ["all", "3", "5"] and f"{result.map50_95:.3f}" in text[1]
    written = list(csv.DictReader(result.write_csv(tmp_path / "per_class.csv", ["cat", "dog", "emu"]).open()))
    assert [r["class"] for r in written] == ["all", "cat", "dog"]
    assert float(written[0]["mAP50"]) == pytest.approx(result.map50, abs=1e-5)


def eighty_classes():
    """An EvalResult of 80 classes (as COCO's), each with ground truth, class 1 named ``<b>``."""
    k = np.arange(80)
    return EvalResult(map50_95=0.3012, map50=0.45678, precision=0.5123, recall=0.4311, images=5000,
                      per_class_ap=k / 200, per_class_ap50=k / 100, per_class_precision=np.full(80, 0.5),
                      per_class_recall=np.full(80, 0.25), class_images=k + 1, class_instances=2 * k + 1,
                      names=["person", "<b>", *(f"class {i}" for i in range(2, 80))])


def test_repr_is_one_short_line_of_the_all_row():
    result = eighty_classes()
    assert repr(result) == "EvalResult(5000 images, 6400 instances: P 0.512, R 0.431, mAP50 0.457, mAP50-95 0.301)"
    assert len(repr(result)) < 300 and len(str(result)) < 300      # the dataclass's own repr: ~17,000
    assert repr(EvalResult()).startswith("EvalResult(0 images, 0 instances: P 0.000")


def test_repr_html_is_the_per_class_table_with_names_escaped():
    page = eighty_classes()._repr_html_()
    assert page.startswith("<table>") and page.count("<tr>") == 1 + 81    # header, "all", 80 classes
    assert "<th>class</th><th>images</th><th>instances</th><th>P</th><th>R</th><th>mAP50</th>" in page
    assert "<tr><td>all</td><td>5000</td><td>6400</td><td>0.512</td><td>0.431</td><td>0.457</td><td>0.301</td></tr>" \
        in page
    assert "<tr><td>person</td><td>1</td><td>1</td><td>0.500</td><td>0.250</td><td>0.000</td><td>0.000</td></tr>" \
        in page
    assert "<tr><td>&lt;b&gt;</td><td>2</td><td>3</td><td>0.500</td><td>0.250</td><td>0.010</td><td>0.005</td>" \
        in page and "<b>" not in page
    assert all(f"<tr><td>class {i}</td><td>{i + 1}</td><td>{2 * i + 1}</td>" in page for i in range(2, 80))
    unnamed = dataclasses.replace(eighty_classes(), names=None)._repr_html_()
    assert "<tr><td>79</td><td>80</td><td>159</td>" in unnamed            # class indices without names


def test_names_travel_with_the_result():
    preds, targets, shapes = handmade()
    result = coco_evaluate(preds, targets, shapes, num_classes=3, names=("cat", "dog", "emu"))
    assert result.names == ["cat", "dog", "emu"] and [r["class"] for r in result.table()] == ["all", "cat", "dog"]
    assert [r["class"] for r in result.table(["x", "y", "z"])] == ["all", "x", "y"]    # given names win
    again = pickle.loads(pickle.dumps(result))
    assert again.names == result.names and again.as_dict() == result.as_dict()
    assert dataclasses.replace(result, map50=1.0).names == ["cat", "dog", "emu"]
    assert coco_evaluate(preds, targets, shapes, num_classes=3).names is None
