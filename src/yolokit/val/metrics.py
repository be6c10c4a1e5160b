"""Box metrics over arrays: COCO mAP, per-class table, P/R/F1 curves, confusion matrix.

Predictions and ground truth are given per image in the same (original image) pixel
frame (:func:`yolokit.val.validate` gathers them from a model and a loader). mAP50 and
mAP50-95 are COCO's: by default scored by ``yolokit.val.cocoeval``
(pycocotools' ``COCOeval`` algorithm on whole arrays: the same numbers, tens of times
faster); ``backend="pycocotools"`` runs ``COCOeval`` itself. Precision and recall are
read as the usual YOLO validators read them: detections matched to ground truth of their
class at IoU 0.5, precision and recall per class as functions of the confidence, both
taken at the confidence where the class-mean F1 (lightly smoothed) is best. The
confusion matrix counts detections above confidence 0.25 matched to any ground truth at
IoU 0.45 (``yolokit.val.matching``).
"""

from __future__ import annotations

import contextlib
import csv
import html
import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from yolokit.ops.nms import Detections
from yolokit.val.cocoeval import RECALL_THRESHOLDS, evaluate_boxes
from yolokit.val.matching import confusion_matrix, matches_at_iou

COLUMNS = ["class", "images", "instances", "P", "R", "mAP50", "mAP50-95"]  # of EvalResult.table's rows
SCORES = COLUMNS[3:]
MASK_SCORES = ["mask P", "mask R", "mask mAP50", "mask mAP50-95"]   # a segmentation model's columns after SCORES


def html_table(head: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """An HTML ``<table>``: a header row, then one row per item of ``rows``; each cell ``str()``-ed and
    HTML-escaped (what a notebook's ``_repr_html_`` returns)."""
    def cells(tag: str, values: Iterable[Any]) -> str:
        return "".join(f"<{tag}>{html.escape(str(v))}</{tag}>" for v in values)

    body = "".join(f"<tr>{cells('td', row)}</tr>" for row in rows)
    return f"<table><thead><tr>{cells('th', head)}</tr></thead><tbody>{body}</tbody></table>"


@dataclass
class EvalResult:
    """Box metrics of one evaluation.

    Attributes:
        map50_95: mean AP over IoU 0.50:0.95 (COCO's AP).
        map50: mean AP at IoU 0.50.
        precision: mean precision over classes with ground truth, at ``best_conf``.
        recall: mean recall at ``best_conf``.
        per_class_ap: [C] AP50-95 per class index, NaN for classes absent from the ground truth.
        per_class_ap50: [C] AP50 per class, NaN likewise.
        per_class_precision: [C] precision at ``best_conf`` (IoU 0.5), NaN likewise.
        per_class_recall: [C] recall at ``best_conf``, NaN likewise.
        class_images: [C] images holding the class in their ground truth.
        class_instances: [C] ground truth boxes of the class.
        images: images evaluated.
        best_conf: the confidence of best mean F1.
        pr_recall: the 101 recall points of COCO's PR curve.
        pr_precision: [C, 101] interpolated precision at IoU 0.5 (-1 where undefined).
        conf_points: [1000] confidences in [0, 1] of the curves below.
        conf_precision: [C, 1000] precision of detections scoring at least each confidence.
        conf_recall: [C, 1000] recall likewise.
        conf_f1: [C, 1000] their F1.
        confusion: [C + 1, C + 1] counts, rows predicted class, columns true class; the
            last row and column are background (missed boxes, false detections).
        stats: COCOeval's 12 summary numbers.
        mask_map50, mask_map50_95: a segmentation model's mask AP (COCO's ``segm``), else None.
        per_class_mask_ap50, per_class_mask_ap: [C] its mask AP50 and AP50-95 per class, NaN likewise.
        mask_precision, mask_recall: its masks' precision and recall as the boxes' are read (matched at mask
            IoU 0.5), at the masks' own best-F1 confidence, else None.
        per_class_mask_precision, per_class_mask_recall: [C] the same per class, NaN likewise.
        names: class names by index, when the evaluation knew them (``validate`` takes the split's);
            ``table()`` and the notebook view use them, else class indices.

    Printed, it is one line (``repr``: images, instances, P, R, mAP50, mAP50-95 of all classes); in a
    notebook, its per-class table (``_repr_html_``).
    """

    map50_95: float = 0.0
    map50: float = 0.0
    precision: float = 0.0
    recall: float = 0.0
    per_class_ap: np.ndarray = field(default_factory=lambda: np.zeros(0))
    per_class_ap50: np.ndarray = field(default_factory=lambda: np.zeros(0))
    per_class_precision: np.ndarray = field(default_factory=lambda: np.zeros(0))
    per_class_recall: np.ndarray = field(default_factory=lambda: np.zeros(0))
    class_images: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    class_instances: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    images: int = 0
    best_conf: float = 0.0
    pr_recall: np.ndarray = field(default_factory=lambda: np.linspace(0, 1, 101))
    pr_precision: np.ndarray = field(default_factory=lambda: np.zeros((0, 101)))
    conf_points: np.ndarray = field(default_factory=lambda: CONF_POINTS.copy())
    conf_precision: np.ndarray = field(default_factory=lambda: np.zeros((0, len(CONF_POINTS))))
    conf_recall: np.ndarray = field(default_factory=lambda: np.zeros((0, len(CONF_POINTS))))
    conf_f1: np.ndarray = field(default_factory=lambda: np.zeros((0, len(CONF_POINTS))))
    confusion: np.ndarray = field(default_factory=lambda: np.zeros((1, 1), np.int64))
    stats: np.ndarray = field(default_factory=lambda: np.zeros(12))
    names: list[str] | None = None
    mask_map50: float | None = None
    mask_map50_95: float | None = None
    per_class_mask_ap50: np.ndarray | None = None
    per_class_mask_ap: np.ndarray | None = None
    mask_precision: float | None = None
    mask_recall: float | None = None
    per_class_mask_precision: np.ndarray | None = None
    per_class_mask_recall: np.ndarray | None = None

    @property
    def fitness(self) -> float:
        """Model selection score: 0.1 mAP50 + 0.9 mAP50-95; with masks, the boxes' plus the masks' (as the
        reference sums its box and mask fitness)."""
        masks = 0.0 if self.mask_map50 is None else 0.1 * self.mask_map50 + 0.9 * (self.mask_map50_95 or 0.0)
        return 0.1 * self.map50 + 0.9 * self.map50_95 + masks

    def as_dict(self) -> dict[str, float]:
        """The headline numbers (results.csv's columns): P, R, mAP50, mAP50-95, and a segmentation model's
        ``mask_precision``, ``mask_recall``, ``mask_mAP50`` and ``mask_mAP50-95``."""
        out = {"precision": self.precision, "recall": self.recall, "mAP50": self.map50, "mAP50-95": self.map50_95}
        if self.mask_map50 is not None:
            out.update({"mask_precision": self.mask_precision or 0.0, "mask_recall": self.mask_recall or 0.0,
                        "mask_mAP50": self.mask_map50, "mask_mAP50-95": self.mask_map50_95 or 0.0})
        return out

    def scores(self) -> list[str]:
        """The score columns of ``table()``: ``SCORES``, and a segmentation model's ``MASK_SCORES``."""
        return SCORES + (MASK_SCORES if self.mask_map50 is not None else [])

    def table(self, names: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Rows ``class, images, instances, P, R, mAP50, mAP50-95`` (and a segmentation model's ``mask P``,
        ``mask R``, ``mask mAP50``, ``mask mAP50-95``): "all" first, then each class with ground truth, named
        by ``names``, else by ``self.names``, else by its index."""
        names = list(names if names is not None else self.names or [])
        rows = [{"class": "all", "images": self.images, "instances": int(self.class_instances.sum()),
                 "P": self.precision, "R": self.recall, "mAP50": self.map50, "mAP50-95": self.map50_95}]
        for k in np.flatnonzero(self.class_instances > 0):
            rows.append({"class": names[k] if k < len(names) else str(k), "images": int(self.class_images[k]),
                         "instances": int(self.class_instances[k]), "P": float(self.per_class_precision[k]),
                         "R": float(self.per_class_recall[k]), "mAP50": float(self.per_class_ap50[k]),
                         "mAP50-95": float(self.per_class_ap[k])})
        if self.mask_map50 is not None:   # a segmentation model: its masks' P, R and AP, all classes then each
            rows[0].update({"mask P": self.mask_precision or 0.0, "mask R": self.mask_recall or 0.0,
                            "mask mAP50": self.mask_map50, "mask mAP50-95": self.mask_map50_95 or 0.0})
            p, r, ap50, ap = (np.full(len(self.class_instances), np.nan) if a is None else a
                              for a in (self.per_class_mask_precision, self.per_class_mask_recall,
                                        self.per_class_mask_ap50, self.per_class_mask_ap))
            for row, k in zip(rows[1:], np.flatnonzero(self.class_instances > 0), strict=True):
                row.update({"mask P": float(p[k]), "mask R": float(r[k]), "mask mAP50": float(ap50[k]),
                            "mask mAP50-95": float(ap[k])})
        return rows

    def format_table(self, names: Sequence[str] | None = None) -> str:
        """``table()`` as aligned text, as the usual YOLO validators print it."""
        scores = self.scores()
        head = f"{'Class':>22}{'Images':>11}{'Instances':>11}" + "".join(f"{k:>{max(11, len(k) + 2)}}" for k in scores)
        lines = [head] + [f"{r['class']:>22.22}{r['images']:>11}{r['instances']:>11}" + "".join(
            f"{r[k]:>{max(11, len(k) + 2)}.3f}" for k in scores) for r in self.table(names)]
        return "\n".join(lines)

    def __repr__(self) -> str:
        every = self.table()[0]  # "all"
        masks = "" if self.mask_map50 is None else (f"; masks P {self.mask_precision or 0.0:.3f}, "
                                                    f"R {self.mask_recall or 0.0:.3f}, mAP50 {self.mask_map50:.3f}, "
                                                    f"mAP50-95 {self.mask_map50_95 or 0.0:.3f}")
        return (f"EvalResult({every['images']} images, {every['instances']} instances: " + ", ".join(
            f"{k} {every[k]:.3f}" for k in SCORES) + masks + ")")

    def _repr_html_(self) -> str:
        """``table()`` as an HTML table (a notebook shows it), scores to 3 decimals."""
        scores = self.scores()
        return html_table(COLUMNS[:3] + scores, [[r["class"], r["images"], r["instances"],
                                                  *(f"{r[k]:.3f}" for k in scores)] for r in self.table()])

    def write_csv(self, path: str | Path, names: Sequence[str] | None = None) -> Path:
        """``table()`` as CSV (full precision)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS[:3] + self.scores())
            writer.writeheader()
            for row in self.table(names):
                writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
        return path


def coco_structures(
    predictions: Sequence[Detections],
    targets: Sequence[tuple[np.ndarray, np.ndarray]],
    shapes: Sequence[tuple[int, int]],
    num_classes: int,
) -> tuple[dict, list[dict]]:
    """(ground-truth dataset dict, detection list) in COCO json form; category id = class + 1."""
    images, annotations, results = [], [], []
    for image_id, (det, (boxes, labels), (h, w)) in enumerate(zip(predictions, targets, shapes, strict=True), start=1):
        images.append({"id": image_id, "height": int(h), "width": int(w)})
        boxes, labels = np.asarray(boxes, dtype=np.float64).reshape(-1, 4), np.asarray(labels).reshape(-1)
        for box, label in zip(boxes, labels, strict=True):
            bw, bh = box[2] - box[0], box[3] - box[1]
            annotations.append({"id": len(annotations) + 1, "image_id": image_id, "category_id": int(label) + 1,
                                "bbox": [float(box[0]), float(box[1]), float(bw), float(bh)],
                                "area": float(bw * bh), "iscrowd": 0})
        d = det.numpy()
        for box, score, label in zip(d.boxes.astype(np.float64), d.scores, d.labels, strict=True):
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
    names: Sequence[str] | None = None,
) -> EvalResult:
    """Scores detections against ground truth: COCO's box AP, per-class table, curves, confusion.

    Args:
        predictions: per image, ``Detections`` in original pixels.
        targets: per image, (boxes Tensor/ndarray[G, 4] xyxy original pixels, labels [G]).
        shapes: per image, (height, width).
        num_classes: number of classes.
        backend: ``"yolokit"`` (array evaluator, pycocotools' numbers) or
            ``"pycocotools"`` (``COCOeval`` itself).
        names: class names by index, kept as ``EvalResult.names`` for its table.

    Returns:
        ``EvalResult``; AP, P and R are zero when there is no ground truth or no detection.
    """
    if not (len(predictions) == len(targets) == len(shapes)):
        raise ValueError(f"got {len(predictions)} predictions, {len(targets)} targets, {len(shapes)} shapes")
    if backend not in ("yolokit", "pycocotools"):
        raise ValueError(f"backend must be 'yolokit' or 'pycocotools', got {backend!r}")
    gt_boxes = [np.asarray(b, np.float64).reshape(-1, 4) for b, _ in targets]
    gt_labels = [np.asarray(label, np.int64).reshape(-1) for _, label in targets]
    dets = [d.numpy() for d in predictions]
    coco = _coco_precision(predictions, targets, shapes, num_classes, backend, gt_boxes, gt_labels)
    result = _result(*coco, num_classes) if coco is not None else EvalResult(
        per_class_ap=np.full(num_classes, np.nan), per_class_ap50=np.full(num_classes, np.nan),
        pr_precision=np.zeros((num_classes, 101)))
    result.images = len(targets)
    result.class_instances = np.bincount(np.concatenate(gt_labels + [np.zeros(0, np.int64)]), minlength=num_classes)
    result.class_images = np.bincount(np.concatenate([np.unique(g) for g in gt_labels] + [np.zeros(0, np.int64)]),
                                      minlength=num_classes)
    tp = [matches_at_iou(d.boxes, d.scores, d.labels, b, g, 0.5)
          for d, b, g in zip(dets, gt_boxes, gt_labels, strict=True)]
    _confidence_metrics(result, _joined_np([d.scores for d in dets], np.float64), _joined_np(tp, bool),
                        _joined_np([d.labels for d in dets], np.int64))
    result.confusion = confusion_matrix(dets, gt_boxes, gt_labels, num_classes)
    result.names = list(names) if names is not None else None
    return result


def _coco_precision(predictions: Sequence[Detections], targets: Sequence, shapes: Sequence, num_classes: int,
                    backend: str, gt_boxes: list[np.ndarray], gt_labels: list[np.ndarray]):
    """(COCOeval precision [T, R, K, A, M], stats), or None without ground truth or detections."""
    counts = [len(d) for d in predictions]
    if not sum(len(b) for b in gt_boxes) or not sum(counts):
        return None
    if backend == "pycocotools":
        COCO, COCOeval = _pycocotools()
        gt_dict, results = coco_structures(predictions, targets, shapes, num_classes)
        with contextlib.redirect_stdout(io.StringIO()):
            gt = COCO()
            gt.dataset = gt_dict
            gt.createIndex()
            evaluator = COCOeval(gt, gt.loadRes(results), "bbox")
            evaluator.evaluate()
            evaluator.accumulate()
            evaluator.summarize()
        return evaluator.eval["precision"], evaluator.stats
    box_eval = evaluate_boxes(
        np.concatenate(gt_boxes), np.concatenate(gt_labels),
        np.repeat(np.arange(len(targets)), [len(b) for b in gt_boxes]),
        _joined([d.boxes.reshape(-1, 4) for d in predictions]), _joined([d.scores.reshape(-1) for d in predictions]),
        _joined([d.labels.reshape(-1) for d in predictions]),
        np.repeat(np.arange(len(predictions)), counts), num_classes)
    return box_eval.precision[..., None], box_eval.stats


def _pycocotools() -> tuple[type, type]:
    """pycocotools' ``COCO`` and ``COCOeval``, imported where the pycocotools backend needs them."""
    try:
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval
    except ImportError as exc:
        raise ImportError("backend='pycocotools' needs pycocotools (pip install pycocotools); the default "
                          "backend='yolokit' computes the same numbers without it") from exc
    return COCO, COCOeval


def _joined(tensors: list[torch.Tensor]) -> np.ndarray:
    return torch.cat(tensors).detach().cpu().numpy()


def _joined_np(arrays: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate([np.asarray(a, dtype).reshape(-1) for a in arrays] + [np.zeros(0, dtype)])


def _result(precision: np.ndarray, stats: np.ndarray, num_classes: int) -> EvalResult:
    """EvalResult's COCO part from COCOeval's [T, R, K, A, M] precision (class k at index k) and its stats."""
    precision = precision[:, :, :, 0, -1]  # [T, R, K], area all, most detections
    per_class, per_class50 = np.full(num_classes, np.nan), np.full(num_classes, np.nan)
    for k in range(precision.shape[2]):
        p = precision[:, :, k]
        if (p > -1).any():  # -1 marks a class without ground truth
            per_class[k], per_class50[k] = p[p > -1].mean(), p[0][p[0] > -1].mean()
    return EvalResult(map50_95=float(stats[0]), map50=float(stats[1]), per_class_ap=per_class,
                      per_class_ap50=per_class50, pr_recall=RECALL_THRESHOLDS.copy(), pr_precision=precision[0].T,
                      stats=np.array(stats, np.float64))


CONF_POINTS = np.linspace(0, 1, 1000)


def _confidence_metrics(result: EvalResult, scores: np.ndarray, tp: np.ndarray, labels: np.ndarray) -> None:
    """Fills the per-class precision / recall / F1 curves over ``CONF_POINTS``, the best-F1
    confidence, and precision and recall there (per class and their mean over classes with
    ground truth)."""
    curves = confidence_curves(scores, tp, labels, result.class_instances)
    result.conf_points = CONF_POINTS.copy()
    result.conf_precision, result.conf_recall, result.conf_f1 = curves.precision, curves.recall, curves.f1
    result.per_class_precision, result.per_class_recall = curves.per_class_precision, curves.per_class_recall
    if curves.best is not None:
        result.best_conf = float(CONF_POINTS[curves.best])
        result.precision, result.recall = curves.mean_precision, curves.mean_recall


class ConfidenceCurves(NamedTuple):
    """Precision, recall and F1 per class over ``CONF_POINTS`` ([C, 1000] each), the index of the best
    smoothed class-mean F1 (None without ground truth), per-class precision and recall there ([C], NaN for a
    class without ground truth), and their means over the classes with ground truth."""

    precision: np.ndarray
    recall: np.ndarray
    f1: np.ndarray
    best: int | None
    per_class_precision: np.ndarray
    per_class_recall: np.ndarray
    mean_precision: float
    mean_recall: float


def confidence_curves(scores: np.ndarray, tp: np.ndarray, labels: np.ndarray,
                      instances: np.ndarray) -> ConfidenceCurves:
    """The usual YOLO validators' precision and recall: each class's detections by falling score, ``tp`` (bool
    [D]: matched at IoU 0.5) counted against ``instances`` ([C] ground truths per class), read at the confidence
    where the class-mean F1, smoothed by a box filter over a tenth of the range (as the reference smooths), is
    best."""
    num_classes = len(instances)
    shape = (num_classes, len(CONF_POINTS))
    p_curve, r_curve = np.zeros(shape), np.zeros(shape)
    order = np.argsort(-scores, kind="stable")
    scores, tp, labels = scores[order], tp[order], labels[order]
    present = np.flatnonzero(instances > 0)
    for k in present:
        mine = labels == k
        if not mine.any():
            continue
        hits = np.cumsum(tp[mine])
        recall = hits / instances[k]
        precision = hits / np.arange(1, len(hits) + 1)
        r_curve[k] = np.interp(-CONF_POINTS, -scores[mine], recall, left=0)  # scores fall as we go
        p_curve[k] = np.interp(-CONF_POINTS, -scores[mine], precision, left=1)
    f1 = 2 * p_curve * r_curve / np.maximum(p_curve + r_curve, 1e-16)
    per_p, per_r = np.full(num_classes, np.nan), np.full(num_classes, np.nan)
    if not len(present):
        return ConfidenceCurves(p_curve, r_curve, f1, None, per_p, per_r, 0.0, 0.0)
    width = round(len(CONF_POINTS) * 0.1 / 2)  # a box filter over 10% of the range, as the reference smooths
    mean_f1 = f1[present].mean(0)
    smooth = np.convolve(np.pad(mean_f1, width, mode="edge"), np.ones(2 * width + 1) / (2 * width + 1), "valid")
    best = int(smooth.argmax())
    per_p[present], per_r[present] = p_curve[present, best], r_curve[present, best]
    return ConfidenceCurves(p_curve, r_curve, f1, best, per_p, per_r, float(per_p[present].mean()),
                            float(per_r[present].mean()))
