"""Mask metrics of a segmentation model's validation, by COCO's protocol: each detection's mask in its original
image (``Detector.predict`` gives them), scored against the ground truth's original polygons rasterized as
pycocotools rasterizes a COCO json's polygons; AP over them as ``COCOeval(..., "segm")`` computes it
(``cocoeval.evaluate_masks``). A row without a polygon (a box row of a mixed set) is scored as its box's
rectangle, the mask it would have in a COCO json made from its box.

Masks are kept cropped to their pixels' bounds (``cocoeval.CroppedMasks``): a split's masks take the memory of
their objects, not of whole images.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from yolokit.ops.masks import MaskCrops
from yolokit.val.cocoeval import CroppedMasks, evaluate_masks
from yolokit.val.matching import greedy_match
from yolokit.val.metrics import confidence_curves

MaskRecord = tuple[CroppedMasks, CroppedMasks, np.ndarray]   # (detections' masks, ground truth's, its labels)


def polygon_masks(polygons: Sequence[np.ndarray | None], boxes: np.ndarray, shape: tuple[int, int]) -> CroppedMasks:
    """Ground truth masks as pycocotools rasterizes polygons (``frPyObjects``, then decoded).

    Args:
        polygons: each row's polygon, float [K, 2] in original pixels, or None (its box's rectangle).
        boxes: float [G, 4] xyxy in original pixels.
        shape: (height, width) of the original image.
    """
    from pycocotools import mask as mask_utils  # here: only a segmentation validation needs it

    h, w = int(shape[0]), int(shape[1])
    masks = []
    for poly, box in zip(polygons, np.asarray(boxes, np.float64).reshape(-1, 4), strict=True):
        if poly is None:
            x1, y1, x2, y2 = box
            poly = np.array([[x1, y1], [x2, y1], [x2, y2], [x1, y2]])
        rle = mask_utils.frPyObjects([np.asarray(poly, np.float64).reshape(-1).tolist()], h, w)
        with warnings.catch_warnings():   # pycocotools' decode under NumPy 2: a DeprecationWarning per call
            warnings.simplefilter("ignore", DeprecationWarning)
            masks.append(mask_utils.decode(mask_utils.merge(rle)))
    return CroppedMasks.from_masks(masks)


def ground_truth(dataset: Any, index: int, shape: tuple[int, int]) -> tuple[CroppedMasks, np.ndarray] | None:
    """Image ``index``'s ground truth masks and labels from a segmentation set's own polygons
    (``DetectionDataset.index``); None when the set has none."""
    split = getattr(dataset, "index", None)
    segments = getattr(split, "segments", None)
    if segments is None:
        return None
    labels = np.asarray(split.labels[index], np.float64).reshape(-1, 5)
    return polygon_masks(segments.image(index), labels[:, 1:5], shape), labels[:, 0].astype(np.int64)


def mask_record(masks: Any, dataset: Any, index: int, shape: tuple[int, int]) -> MaskRecord | None:
    """One image's part of the mask metrics: its detections' masks (Tensor or ndarray [K, H, W]) and its
    ground truth; None when either is missing (a detection model, a set without polygons)."""
    if masks is None:
        return None
    truth = ground_truth(dataset, index, shape)
    if truth is None:
        return None
    if isinstance(masks, MaskCrops):                 # Detector.predict(mask_form="crops"): never whole images
        masks = masks.to("cpu")
        return CroppedMasks.from_windows(masks.windows.numpy(), [c.numpy() for c in masks.crops]), truth[0], truth[1]
    dets = masks.cpu().numpy() if hasattr(masks, "cpu") else np.asarray(masks)
    return CroppedMasks.from_masks(list(dets)), truth[0], truth[1]


class MaskScores(NamedTuple):
    """Mask AP over a split: over all classes, and per class ([C], NaN for a class without ground truth); and
    precision and recall as the boxes' are read (``metrics.confidence_curves``), at mask IoU 0.5."""

    map50: float
    map50_95: float
    per_class_ap50: np.ndarray
    per_class_ap: np.ndarray
    precision: float
    recall: float
    per_class_precision: np.ndarray
    per_class_recall: np.ndarray


def mask_matches(record: MaskRecord, scores: np.ndarray, labels: np.ndarray, threshold: float = 0.5) -> np.ndarray:
    """[D] bool: the detection's mask takes a ground truth mask of its class at mask IoU >= ``threshold``, greedy
    by score (``matching.greedy_match``, as the boxes are matched for P and R)."""
    dets, truth, truth_labels = record
    labels = np.asarray(labels).reshape(-1)
    iou = np.zeros((len(dets), len(truth)))
    d, g = np.nonzero(labels[:, None] == np.asarray(truth_labels).reshape(-1)[None, :])
    if len(d):
        iou[d, g] = dets.pair_iou(truth, d, g)
    return greedy_match(iou, np.asarray(scores).reshape(-1), threshold) >= 0


def mask_scores(records: Sequence[MaskRecord], scores: Sequence[np.ndarray], labels: Sequence[np.ndarray],
                num_classes: int) -> MaskScores:
    """Mask AP of a split (COCO's ``segm``), per image its ``MaskRecord`` and its detections' scores and labels
    (as the masks are ordered); 0 without ground truth or detections."""
    gt_images = np.concatenate([np.full(len(r[1]), i) for i, r in enumerate(records)] + [np.zeros(0, np.int64)])
    det_images = np.concatenate([np.full(len(r[0]), i) for i, r in enumerate(records)] + [np.zeros(0, np.int64)])
    gt_labels = np.concatenate([r[2] for r in records] + [np.zeros(0, np.int64)])
    per_class, per_class50 = np.full(num_classes, np.nan), np.full(num_classes, np.nan)
    curves = confidence_curves(
        np.concatenate([np.asarray(s, np.float64).reshape(-1) for s in scores] + [np.zeros(0)]),
        np.concatenate([mask_matches(r, s, c) for r, s, c in zip(records, scores, labels, strict=True)]
                       + [np.zeros(0, bool)]),
        np.concatenate([np.asarray(c, np.int64).reshape(-1) for c in labels] + [np.zeros(0, np.int64)]),
        np.bincount(gt_labels, minlength=num_classes))
    pr = (curves.mean_precision, curves.mean_recall, curves.per_class_precision, curves.per_class_recall)
    if not len(gt_images) or not len(det_images):
        per_class[np.unique(gt_labels)] = per_class50[np.unique(gt_labels)] = 0.0
        return MaskScores(0.0, 0.0, per_class50, per_class, *pr)
    result = evaluate_masks(_joined([r[1] for r in records]), gt_labels, gt_images,
                            _joined([r[0] for r in records]), np.concatenate([np.asarray(s) for s in scores]),
                            np.concatenate([np.asarray(c) for c in labels]), det_images, num_classes)
    precision = result.precision[:, :, :, 0]                              # [T, R, K], area all
    for k in range(num_classes):
        p = precision[:, :, k]
        if (p > -1).any():                                                 # -1: no ground truth of class k
            per_class[k], per_class50[k] = p[p > -1].mean(), p[0][p[0] > -1].mean()
    return MaskScores(max(float(result.stats[1]), 0.0), max(float(result.stats[0]), 0.0), per_class50, per_class,
                      *pr)


def _joined(parts: Sequence[CroppedMasks]) -> CroppedMasks:
    return CroppedMasks(np.concatenate([p.bounds for p in parts]).reshape(-1, 4),
                        [c for p in parts for c in p.crops], np.concatenate([p.area for p in parts]))
