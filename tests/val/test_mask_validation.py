"""A segmentation model's validation: its masks in original pixels, scored against the split's own polygons as
COCO's ``segm`` evaluation scores them (``yolokit.val.masks``).

The model is a stand-in that reads the loader's batches in step with ``validate`` (the same loader again, no
shuffle, no workers) and answers each image with its own ground truth: perfect masks give 1.0; the same masks
cut back for every other object give the number pycocotools computes from the polygons and the masks' RLEs.
"""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import torch

from yolokit.data import DetectionDataset, build_dataloader, make_shapes
from yolokit.ops.nms import Detections
from yolokit.val import validate
from yolokit.val.masks import polygon_masks


@pytest.fixture(scope="module")
def seg_val(tmp_path_factory):
    data = make_shapes(tmp_path_factory.mktemp("seg") / "set", n_train=2, n_val=7, imgsz=96, segments=True)
    ds = DetectionDataset(str(data), "val", imgsz=96, rect=True, stride=32)
    return ds, build_dataloader(ds, 3, workers=0, shuffle=False, uint8_images=True, stride=32)   # 3 batches


def truth_masks(ds, i):
    """Image i's ground truth masks as whole bool arrays (pycocotools' rasterization of its polygons)."""
    h, w = (int(v) for v in ds.index.shapes[i])
    return polygon_masks(ds.index.segments.image(i), ds.index.labels[i][:, 1:5], (h, w)).dense((h, w))


def cut(mask, keep: float = 0.6):
    """The mask with only the left ``keep`` of its columns (0.6: an IoU near 0.6)."""
    cols = np.flatnonzero(mask.any(0))
    out = mask.copy()
    if len(cols):
        out[:, cols[0] + int(keep * (cols[-1] - cols[0] + 1)):] = False
    return out


def answer(ds, i, cut_every_other: bool, keep: float = 0.6):
    """The stand-in's masks for image i: its ground truth, every other one cut back when asked."""
    masks = truth_masks(ds, i)
    return np.array([cut(m, keep) if cut_every_other and k % 2 else m for k, m in enumerate(masks)],
                    bool).reshape(masks.shape)


class Oracle(torch.nn.Module):
    """``predict`` answers each image of the loader's next batch with its ground truth (every other mask cut
    back when ``cut``), scores falling with the row."""

    def __init__(self, ds, loader, cut_every_other: bool, keep: float = 0.6):
        super().__init__()
        self.ds, self.batches, self.cut, self.keep = ds, iter(loader), cut_every_other, keep
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def predict(self, images, **kw):
        out = []
        for i in next(self.batches)["indices"]:
            masks = answer(self.ds, int(i), self.cut, self.keep)
            labels = torch.as_tensor(self.ds.index.labels[int(i)][:, 0]).long()
            boxes = torch.as_tensor(self.ds.index.labels[int(i)][:, 1:5]).float()
            scores = torch.linspace(0.9, 0.5, len(labels))
            out.append(Detections(boxes, scores, labels, torch.from_numpy(masks)))
        return out


def pycocotools_segm(ds, oracle_masks) -> np.ndarray:
    """COCOeval(..., "segm") stats: ground truth as the split's polygons, detections as the masks' RLEs."""
    mask_utils = pytest.importorskip("pycocotools.mask")
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    images, annotations, results = [], [], []
    for i in range(len(ds)):
        h, w = (int(v) for v in ds.index.shapes[i])
        images.append({"id": i + 1, "height": h, "width": w})
        labels = ds.index.labels[i]
        for poly, row in zip(ds.index.segments.image(i), labels, strict=True):
            seg = [np.asarray(poly, np.float64).reshape(-1).tolist()]
            rle = mask_utils.merge(mask_utils.frPyObjects(seg, h, w))
            annotations.append({"id": len(annotations) + 1, "image_id": i + 1, "category_id": int(row[0]) + 1,
                                "segmentation": seg, "area": float(mask_utils.area(rle)), "iscrowd": 0,
                                "bbox": [float(v) for v in mask_utils.toBbox(rle)]})
        for k, (m, row) in enumerate(zip(oracle_masks[i], labels, strict=True)):
            rle = mask_utils.encode(np.asfortranarray(m.astype(np.uint8)))
            rle["counts"] = rle["counts"].decode()
            results.append({"image_id": i + 1, "category_id": int(row[0]) + 1, "segmentation": rle,
                            "score": float(np.linspace(0.9, 0.5, len(labels))[k])})
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO()
        gt.dataset = {"images": images, "annotations": annotations,
                      "categories": [{"id": c + 1} for c in range(len(ds.names))]}
        gt.createIndex()
        ev = COCOeval(gt, gt.loadRes(results), "segm")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return ev.stats


def test_perfect_masks_score_one_and_cut_masks_score_what_pycocotools_scores(seg_val):
    ds, loader = seg_val
    assert ds.index.segments is not None and len(ds) == 7
    perfect, _ = validate(Oracle(ds, loader, False), loader, num_classes=len(ds.names))
    assert perfect.mask_map50 == perfect.mask_map50_95 == 1.0 and perfect.map50_95 == 1.0
    assert perfect.fitness == pytest.approx(2.0)

    result, _ = validate(Oracle(ds, loader, True), loader, num_classes=len(ds.names))
    stats = pycocotools_segm(ds, [answer(ds, i, True) for i in range(len(ds))])
    assert result.mask_map50_95 == pytest.approx(stats[0], abs=1e-12) and 0.3 < stats[0] < 0.95
    assert result.mask_map50 == pytest.approx(stats[1], abs=1e-12)
    assert result.map50_95 == 1.0                                       # the boxes were left whole
    assert "masks P 1.000, R 1.000, mAP50 1.000" in repr(result)     # IoU near 0.6: every mask matched at 0.5
    table = result.table()
    assert table[0]["mask mAP50-95"] == result.mask_map50_95 and len(table) > 2
    assert all(row["mask mAP50"] <= 1.0 and row["mask mAP50-95"] <= row["mask mAP50"] for row in table)
    per_class = [row["mask mAP50-95"] for row in table[1:]]     # each class's, their mean the whole's
    assert np.mean(per_class) == pytest.approx(result.mask_map50_95, abs=1e-12)
    assert [row["mask mAP50-95"] for row in perfect.table()] == [1.0] * len(table)
    head = result.format_table().splitlines()[0]
    assert head.split()[-8:] == ["mask", "P", "mask", "R", "mask", "mAP50", "mask", "mAP50-95"]


def test_mask_precision_and_recall_match_masks_at_iou_half_beside_perfect_boxes(seg_val):
    """Every other mask cut to its left fifth (IoU well under 0.5) on a perfect box: the boxes' P and R stay 1,
    the masks' count those as false detections and missed objects, read as the boxes' P and R are read."""
    from yolokit.val.metrics import confidence_curves

    ds, loader = seg_val
    result, _ = validate(Oracle(ds, loader, True, keep=0.2), loader, num_classes=len(ds.names))
    labels = [np.asarray(ds.index.labels[i][:, 0], np.int64) for i in range(len(ds))]
    scores = np.concatenate([np.linspace(0.9, 0.5, len(c)).astype(np.float32) for c in labels]).astype(np.float64)
    hits = np.concatenate([np.arange(len(c)) % 2 == 0 for c in labels])          # the uncut masks only
    expected = confidence_curves(scores, hits, np.concatenate(labels), np.bincount(np.concatenate(labels)))
    assert (result.precision, result.recall, result.map50_95) == (1.0, 1.0, 1.0)
    assert result.mask_precision == expected.mean_precision and result.mask_recall == expected.mean_recall
    assert result.mask_recall < 0.9 and 0 < result.mask_precision <= 1
    np.testing.assert_array_equal(result.per_class_mask_precision, expected.per_class_precision)
    row = result.table()[0]
    assert (row["mask P"], row["mask R"]) == (result.mask_precision, result.mask_recall)
    assert list(result.as_dict())[-4:] == ["mask_precision", "mask_recall", "mask_mAP50", "mask_mAP50-95"]


def test_a_box_row_is_scored_as_its_rectangle():
    boxes = np.array([[2.0, 3.0, 10.0, 8.0], [0.0, 0.0, 4.0, 4.0]])
    masks = polygon_masks([None, np.array([[0.0, 0.0], [4.0, 0.0], [0.0, 4.0]])], boxes, (12, 16))
    assert list(masks.bounds[0]) == [2, 3, 10, 8] and masks.crops[0].all() and masks.area[0] == 8 * 5
    assert 6 <= masks.area[1] <= 12                                     # a triangle of area 8


def test_the_samples_carry_the_masks_a_samples_plot_fills(seg_val, tmp_path, monkeypatch):
    """A segmentation model's validation samples: the ground truth as the set's rows with their polygons' masks,
    the predictions scoring at least 0.25 with theirs (the ones a samples plot shows), and the plot draws both."""
    from yolokit.train import plots

    ds, loader = seg_val

    class Fading(Oracle):
        def predict(self, images, **kw):
            out = super().predict(images, **kw)
            return [Detections(d.boxes, torch.linspace(0.9, 0.1, len(d.scores)), d.labels, d.masks) for d in out]

    _, samples = validate(Fading(ds, loader, False), loader, num_classes=len(ds.names), keep_samples=5)
    order = [int(i) for batch in loader for i in batch["indices"]]      # rect batches: by aspect ratio
    assert len(samples) == 5
    for i, (image, pred, truth) in zip(order, samples, strict=False):
        whole = truth_masks(ds, i)
        assert image.shape[:2] == whole.shape[1:]
        assert torch.equal(truth.masks, torch.from_numpy(whole))
        assert torch.equal(truth.labels, torch.as_tensor(ds.index.labels[i][:, 0]).long())
        shown = torch.linspace(0.9, 0.1, len(whole)) >= 0.25
        assert torch.equal(pred.masks, torch.from_numpy(whole)[shown]) and len(pred) == int(shown.sum())
    drawn = []
    monkeypatch.setattr(plots, "draw_detections", lambda image, det, *a, **k: drawn.append(det) or image)
    plots.samples_plot(samples, ds.names, tmp_path / "val_predictions.jpg")
    assert len(drawn) == 10 and all(d.masks is not None and len(d.masks) == len(d.boxes) for d in drawn)


def test_validation_keeps_a_segmentation_models_masks_in_their_boxes_with_the_same_records(seg_val, monkeypatch):
    """A segmentation Detector is validated with ``mask_form="crops"`` (memory the boxes' areas, never K whole
    images of the original size): every image's mask record (bounds, pixels, areas) equals the one made from
    whole masks, and no whole mask is made for the metric (only for the samples asked for)."""
    import yolokit
    from yolokit.models import detector
    from yolokit.ops.masks import MaskCrops
    from yolokit.val import loop

    ds, loader = seg_val
    torch.manual_seed(0)
    model = yolokit.create_model("yolov8n-seg", num_classes=len(ds.names)).eval()

    class Whole:                                   # the same model without a head to look at: whole masks
        def __init__(self, model):
            self.model = model

        def predict(self, images, **kw):
            assert "mask_form" not in kw
            return self.model.predict(images, **kw)

        def parameters(self):
            return self.model.parameters()

        def eval(self):
            return self

        def train(self, mode=True):
            return self

    records, real = {}, loop.mask_record
    monkeypatch.setattr(loop, "mask_record", lambda masks, *a: records.setdefault(key, []).append(
        (type(masks).__name__, real(masks, *a))) or records[key][-1][1])
    key = "whole"
    whole, _ = validate(Whole(model), loader, num_classes=len(ds.names), keep_samples=0, conf=0.0)
    monkeypatch.setattr(detector, "masks_in_original", lambda *a, **k: pytest.fail("a whole mask was made"))
    key = "crops"
    crops, samples = validate(model, loader, num_classes=len(ds.names), keep_samples=2, conf=0.0)
    assert {k for k, _ in records["whole"]} == {"Tensor"} and {k for k, _ in records["crops"]} == {"MaskCrops"}
    assert len(records["crops"]) == len(ds) and sum(len(r[0]) for _, r in records["crops"]) > 2 * len(ds)
    assert sum(int((r[0].area > 0).sum()) for _, r in records["crops"]) > len(ds)     # masks with pixels among them
    for (_, a), (_, b) in zip(records["whole"], records["crops"], strict=True):
        assert np.array_equal(a[0].bounds, b[0].bounds) and np.array_equal(a[0].area, b[0].area)
        assert all(np.array_equal(x, y) for x, y in zip(a[0].crops, b[0].crops, strict=True))
    assert crops.mask_map50_95 == whole.mask_map50_95 and crops.map50_95 == whole.map50_95
    for image, pred, _ in samples:                 # the samples' masks whole, as a samples plot draws them
        assert isinstance(pred.masks, torch.Tensor) and pred.masks.shape == (len(pred), *image.shape[:2])
    assert MaskCrops(torch.zeros(0, 4, dtype=torch.long), []).dense((5, 7)).shape == (0, 5, 7)
