"""COCO box metrics: mAP50-95, mAP50, per-class AP, a PR curve.

Predictions and ground truth are given per image in the same (original image) pixel
frame. By default they are scored by ``yolokit.train.cocoeval`` (pycocotools'
``COCOeval`` algorithm on whole arrays: the same numbers, tens of times faster);
``backend="pycocotools"`` builds in-memory COCO structures and runs ``COCOeval`` itself.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import cv2
import numpy as np
import torch
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch import nn

from yolokit.accel import distributed
from yolokit.data import to_device
from yolokit.ops.boxes import unletterbox_boxes
from yolokit.ops.nms import Detections
from yolokit.train.cocoeval import RECALL_THRESHOLDS, evaluate_boxes


@dataclass
class EvalResult:
    """Box metrics of one evaluation.

    Attributes:
        map50_95: mean AP over IoU 0.50:0.95 (COCO's AP).
        map50: mean AP at IoU 0.50.
        precision: mean precision over classes at the confidence of best mean F1 (IoU 0.5).
        recall: mean recall at that point.
        per_class_ap: AP50-95 per class index, NaN for classes absent from the ground truth.
        pr_recall: the 101 recall points of COCO's PR curve.
        pr_precision: [C, 101] interpolated precision at IoU 0.5 (-1 where undefined).
        stats: COCOeval's 12 summary numbers.
    """

    map50_95: float = 0.0
    map50: float = 0.0
    precision: float = 0.0
    recall: float = 0.0
    per_class_ap: np.ndarray = field(default_factory=lambda: np.zeros(0))
    pr_recall: np.ndarray = field(default_factory=lambda: np.linspace(0, 1, 101))
    pr_precision: np.ndarray = field(default_factory=lambda: np.zeros((0, 101)))
    stats: np.ndarray = field(default_factory=lambda: np.zeros(12))

    def as_dict(self) -> dict[str, float]:
        return {"precision": self.precision, "recall": self.recall, "mAP50": self.map50, "mAP50-95": self.map50_95}


def coco_structures(
    predictions: Sequence[Detections],
    targets: Sequence[tuple[np.ndarray, np.ndarray]],
    shapes: Sequence[tuple[int, int]],
    num_classes: int,
) -> tuple[dict, list[dict]]:
    """(ground-truth dataset dict, detection list) in COCO json form; category id = class + 1."""
    images, annotations, results = [], [], []
    for image_id, (det, (boxes, labels), (h, w)) in enumerate(zip(predictions, targets, shapes), start=1):
        images.append({"id": image_id, "height": int(h), "width": int(w)})
        for box, label in zip(np.asarray(boxes, dtype=np.float64).reshape(-1, 4), np.asarray(labels).reshape(-1)):
            bw, bh = box[2] - box[0], box[3] - box[1]
            annotations.append({"id": len(annotations) + 1, "image_id": image_id, "category_id": int(label) + 1,
                                "bbox": [float(box[0]), float(box[1]), float(bw), float(bh)],
                                "area": float(bw * bh), "iscrowd": 0})
        d = det.numpy()
        for box, score, label in zip(d.boxes.astype(np.float64), d.scores, d.labels):
            results.append({"image_id": image_id, "category_id": int(label) + 1, "score": float(score),
                            "bbox": [float(box[0]), float(box[1]), float(box[2] - box[0]), float(box[3] - box[1])]})
    categories = [{"id": c + 1, "name": str(c)} for c in range(num_classes)]
    return {"images": images, "annotations": annotations, "categories": categories}, results


def coco_evaluate(
    predictions: Sequence[Detections],
    targets: Sequence[tuple[np.ndarray, np.ndarray]],
    shapes: Sequence[tuple[int, int]],
    num_classes: int,
    *,
    backend: str = "yolokit",
) -> EvalResult:
    """Scores detections against ground truth with COCO's box AP.

    Args:
        predictions: per image, ``Detections`` in original pixels.
        targets: per image, (boxes Tensor/ndarray[G, 4] xyxy original pixels, labels [G]).
        shapes: per image, (height, width).
        num_classes: number of classes.
        backend: ``"yolokit"`` (array evaluator, pycocotools' numbers) or
            ``"pycocotools"`` (``COCOeval`` itself).

    Returns:
        ``EvalResult``; all zeros when there is no ground truth or no detection.
    """
    if not (len(predictions) == len(targets) == len(shapes)):
        raise ValueError(f"got {len(predictions)} predictions, {len(targets)} targets, {len(shapes)} shapes")
    if backend not in ("yolokit", "pycocotools"):
        raise ValueError(f"backend must be 'yolokit' or 'pycocotools', got {backend!r}")
    empty = EvalResult(per_class_ap=np.full(num_classes, np.nan), pr_precision=np.zeros((num_classes, 101)))
    if backend == "pycocotools":
        gt_dict, results = coco_structures(predictions, targets, shapes, num_classes)
        if not gt_dict["annotations"] or not results:
            return empty
        with contextlib.redirect_stdout(io.StringIO()):
            gt = COCO()
            gt.dataset = gt_dict
            gt.createIndex()
            dt = gt.loadRes(results)
            evaluator = COCOeval(gt, dt, "bbox")
            evaluator.evaluate()
            evaluator.accumulate()
            evaluator.summarize()
        return _result(evaluator.eval["precision"], evaluator.stats, num_classes)
    gt_boxes = [np.asarray(b, np.float64).reshape(-1, 4) for b, _ in targets]
    gt_labels = [np.asarray(label, np.int64).reshape(-1) for _, label in targets]
    counts = [len(d) for d in predictions]
    if not sum(len(b) for b in gt_boxes) or not sum(counts):
        return empty
    box_eval = evaluate_boxes(
        np.concatenate(gt_boxes), np.concatenate(gt_labels),
        np.repeat(np.arange(len(targets)), [len(b) for b in gt_boxes]),
        _joined([d.boxes.reshape(-1, 4) for d in predictions]), _joined([d.scores.reshape(-1) for d in predictions]),
        _joined([d.labels.reshape(-1) for d in predictions]),
        np.repeat(np.arange(len(predictions)), counts), num_classes)
    return _result(box_eval.precision[..., None], box_eval.stats, num_classes)


def _joined(tensors: list[torch.Tensor]) -> np.ndarray:
    return torch.cat(tensors).detach().cpu().numpy()


def _result(precision: np.ndarray, stats: np.ndarray, num_classes: int) -> EvalResult:
    """EvalResult from COCOeval's [T, R, K, A, M] precision (class k at index k) and its stats."""
    precision = precision[:, :, :, 0, -1]  # [T, R, K], area all, most detections
    per_class = np.full(num_classes, np.nan)
    for k in range(precision.shape[2]):
        p = precision[:, :, k]
        if (p > -1).any():  # -1 marks a class without ground truth
            per_class[k] = p[p > -1].mean()
    pr50 = precision[0].T  # [K, R]
    recall_points = RECALL_THRESHOLDS
    valid = pr50 > -1
    mean_p = np.where(valid, pr50, 0).sum(0) / np.maximum(valid.sum(0), 1)
    f1 = 2 * mean_p * recall_points / np.maximum(mean_p + recall_points, 1e-9)
    best = int(f1.argmax())
    return EvalResult(
        map50_95=float(stats[0]), map50=float(stats[1]),
        precision=float(mean_p[best]), recall=float(recall_points[best]) if f1[best] > 0 else 0.0,
        per_class_ap=per_class, pr_recall=recall_points.copy(), pr_precision=pr50, stats=np.array(stats, np.float64),
    )


@torch.inference_mode()
def validate(
    model: nn.Module,
    loader: Iterable[dict[str, Any]],
    *,
    num_classes: int,
    conf: float = 0.001,
    iou: float = 0.7,
    max_det: int = 300,
    keep_samples: int = 0,
) -> tuple[EvalResult, list[tuple[np.ndarray, Detections]]]:
    """Runs ``model`` over a validation loader and scores it in original image pixels.

    Under several processes each rank runs its shard of the split (``build_dataloader``
    shards it); the per-image predictions and ground truth of all ranks are gathered and
    every rank scores the whole split, in dataset-index order (as one process does), so
    the result equals a one-process validation of the same weights.

    Args:
        model: a ``Detector`` (not DDP-wrapped), put in eval mode for the pass.
        loader: batches of the batch contract (``images``, ``targets``, ``orig_shapes``,
            ``ratio_pad``, ``paths``, ``indices``).
        num_classes: number of classes.
        conf: score threshold (low, as for mAP).
        iou: NMS IoU threshold.
        max_det: detections kept per image.
        keep_samples: also return this many (original RGB image, detections) pairs, for plots.

    Returns:
        ``(result, samples)``.
    """
    device = next(model.parameters()).device
    records, samples = [], []  # per image: (dataset index, detections, (boxes, labels), shape)
    for batch in loader:
        batch = to_device(batch, device, non_blocking=True)
        dets = model.predict(batch["images"], conf=conf, iou=iou, max_det=max_det,
                             orig_shapes=batch["orig_shapes"], ratio_pad=batch["ratio_pad"])
        rows = batch["targets"].cpu()
        indices = batch.get("indices") or [len(records) + i for i in range(len(dets))]
        for i, (det, shape, rp) in enumerate(zip(dets, batch["orig_shapes"], batch["ratio_pad"])):
            mine = rows[rows[:, 0] == i]
            boxes = unletterbox_boxes(mine[:, 2:6], rp, shape) if len(mine) else mine[:, 2:6]
            det = det.to("cpu")
            records.append((int(indices[i]), det, (boxes.numpy(), mine[:, 1].long().numpy()), tuple(shape)))
            if len(samples) < keep_samples:
                samples.append((_read_rgb(batch["paths"][i], shape), det))
    if distributed.world_size() > 1:
        records = [r for part in distributed.all_gather_object(records) for r in part]
    records.sort(key=lambda r: r[0])
    predictions, targets, shapes = ([r[k] for r in records] for k in (1, 2, 3))
    return coco_evaluate(predictions, targets, shapes, num_classes), samples


def _read_rgb(path: str, shape: tuple[int, int]) -> np.ndarray:
    """The original image as RGB (grey if it cannot be read)."""
    image = cv2.imread(path, cv2.IMREAD_COLOR)
    if image is None:
        return np.full((*shape, 3), 114, np.uint8)
    return np.ascontiguousarray(image[..., ::-1])
