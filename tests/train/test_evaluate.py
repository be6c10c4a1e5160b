import contextlib
import io
import json

import numpy as np
import pytest
import torch
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from yolokit.ops.nms import Detections
from yolokit.train.evaluate import coco_evaluate


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
    preds, targets, shapes = handmade()
    result = coco_evaluate(preds, targets, shapes, num_classes=2)
    # the same case written as COCO files, category ids 7 and 9, image ids 100+
    cat = {0: 7, 1: 9}
    gt = {"images": [{"id": 100 + i, "height": h, "width": w} for i, (h, w) in enumerate(shapes)],
          "categories": [{"id": 7, "name": "a"}, {"id": 9, "name": "b"}], "annotations": []}
    for i, (boxes, labels) in enumerate(targets):
        for b, l in zip(boxes, labels):
            gt["annotations"].append({"id": len(gt["annotations"]) + 1, "image_id": 100 + i, "category_id": cat[int(l)],
                                      "bbox": [b[0], b[1], b[2] - b[0], b[3] - b[1]],
                                      "area": (b[2] - b[0]) * (b[3] - b[1]), "iscrowd": 0})
    dets = [{"image_id": 100 + i, "category_id": cat[int(l)], "score": float(s),
             "bbox": [float(b[0]), float(b[1]), float(b[2] - b[0]), float(b[3] - b[1])]}
            for i, d in enumerate(preds) for b, s, l in zip(d.boxes, d.scores, d.labels)]
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
