"""Detections matched to ground truth: pairwise IoU, greedy matching, true positives, confusion.

Everything is numpy on one image's arrays (xyxy boxes in one pixel frame). Matching is
greedy by score, as COCO and the usual YOLO validators match: ``matches_at_iou`` gives the
true-positive flags behind precision and recall, ``confusion_matrix`` the class confusions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from yolokit.ops.nms import Detections


def pairwise_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of xyxy boxes a [N, 4] and b [M, 4] -> [N, M] (float64)."""
    a, b = np.asarray(a, np.float64).reshape(-1, 4), np.asarray(b, np.float64).reshape(-1, 4)
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.clip(rb - lt, 0, None).prod(-1)
    def area(x: np.ndarray) -> np.ndarray:
        return (x[:, 2] - x[:, 0]) * (x[:, 3] - x[:, 1])

    union = area(a)[:, None] + area(b)[None, :] - inter
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)


def greedy_match(iou: np.ndarray, scores: np.ndarray, threshold: float, *, inclusive: bool = True) -> np.ndarray:
    """[D] index of the ground truth box each detection takes (-1: none), greedy by score.

    The detections in descending score order (ties: input order) each take the not yet
    taken box of highest IoU, when that IoU is at least (``inclusive``) or above
    ``threshold``; this is how COCO and the usual YOLO validators match.

    Args:
        iou: [D, G] IoU of detections and ground truth (0 where they may not match).
        scores: [D] detection scores.
    """
    taken_by = np.full(len(scores), -1)
    if not iou.size:
        return taken_by
    passes = (lambda v: v >= threshold) if inclusive else (lambda v: v > threshold)
    free = iou.copy()
    for d in np.argsort(-np.asarray(scores), kind="stable"):
        g = int(free[d].argmax())
        if passes(free[d, g]):
            taken_by[d] = g
            free[:, g] = -1.0
    return taken_by


def matches_at_iou(det_boxes: np.ndarray, det_scores: np.ndarray, det_labels: np.ndarray, gt_boxes: np.ndarray,
                   gt_labels: np.ndarray, threshold: float) -> np.ndarray:
    """[D] bool: the detection takes a ground truth box of its class at IoU >= ``threshold``
    (``greedy_match``)."""
    iou = pairwise_iou(det_boxes, gt_boxes) * (np.asarray(det_labels)[:, None] == np.asarray(gt_labels)[None, :])
    return greedy_match(iou, det_scores, threshold) >= 0


def confusion_matrix(dets: Sequence[Detections], gt_boxes: Sequence[np.ndarray], gt_labels: Sequence[np.ndarray],
                     num_classes: int, *, conf: float = 0.25, iou: float = 0.45) -> np.ndarray:
    """[C + 1, C + 1] counts over images, rows predicted class, columns true class, last background.

    Detections scoring above ``conf`` take ground truth boxes of any class with IoU above
    ``iou`` (``greedy_match``); a matched pair counts as (predicted class, true class), an
    unmatched detection as (its class, background), an unmatched box as (background, its class).
    """
    matrix = np.zeros((num_classes + 1, num_classes + 1), np.int64)
    for det, boxes, labels in zip(dets, gt_boxes, gt_labels, strict=True):
        keep = np.asarray(det.scores) > conf
        d_labels, d_scores = np.asarray(det.labels)[keep], np.asarray(det.scores)[keep]
        taken_by = greedy_match(pairwise_iou(np.asarray(det.boxes).reshape(-1, 4)[keep], boxes), d_scores, iou,
                                inclusive=False)
        hit = taken_by >= 0
        np.add.at(matrix, (d_labels[hit], labels[taken_by[hit]]), 1)
        np.add.at(matrix, (d_labels[~hit], num_classes), 1)
        np.add.at(matrix, (num_classes, np.delete(labels, taken_by[hit])), 1)
    return matrix
