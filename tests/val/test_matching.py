"""Tests of train/matching.py: IoU, greedy matching by score, true positives, the confusion matrix."""

import numpy as np
import torch

from yolokit.ops.nms import Detections
from yolokit.val.matching import confusion_matrix, greedy_match, matches_at_iou, pairwise_iou


def test_pairwise_iou_values_and_empty_boxes():
    a = np.array([[0.0, 0, 10, 10], [5, 5, 5, 5]])  # the second has no area
    b = np.array([[0.0, 0, 10, 10], [5, 0, 15, 10], [20, 20, 30, 30]])
    np.testing.assert_allclose(pairwise_iou(a, b), [[1.0, 50 / 150, 0.0], [0.0, 0.0, 0.0]])
    assert pairwise_iou(a, np.zeros((0, 4))).shape == (2, 0)
    assert pairwise_iou(np.array([[1.0, 1, 1, 1]]), np.array([[1.0, 1, 1, 1]])).tolist() == [[0.0]]  # 0/0 -> 0


def test_matching_is_greedy_by_score():
    gt_boxes, gt_labels = np.array([[0.0, 0, 10, 10]]), np.array([0])
    dets = np.array([[1.0, 1, 10, 10], [0.0, 0, 10, 10]])  # the lower-scoring one fits better
    assert matches_at_iou(dets, np.array([0.9, 0.8]), np.array([0, 0]), gt_boxes, gt_labels, 0.5).tolist() == [
        True, False]
    assert matches_at_iou(dets, np.array([0.7, 0.8]), np.array([0, 0]), gt_boxes, gt_labels, 0.5).tolist() == [
        False, True]
    assert matches_at_iou(dets, np.array([0.9, 0.8]), np.array([1, 0]), gt_boxes, gt_labels, 0.5).tolist() == [
        False, True]  # another class never matches
    iou = np.array([[0.5, 0.45], [0.6, 0.0]])
    assert greedy_match(iou, np.array([0.9, 0.8]), 0.5).tolist() == [0, -1]  # 0.5 >= 0.5 taken first
    assert greedy_match(iou, np.array([0.9, 0.8]), 0.5, inclusive=False).tolist() == [-1, 0]
    assert greedy_match(np.zeros((2, 0)), np.array([0.9, 0.8]), 0.5).tolist() == [-1, -1]  # no ground truth


def test_confusion_matrix_thresholds():
    """conf and iou are strict: a detection at exactly conf is dropped, an IoU of exactly iou does not match."""
    boxes, labels = np.array([[0.0, 0, 10, 10]]), np.array([1])
    det = Detections(torch.tensor([[0.0, 0, 10, 10], [0.0, 0, 10, 10]]), torch.tensor([0.25, 0.3]),
                     torch.tensor([0, 1]))
    np.testing.assert_array_equal(confusion_matrix([det], [boxes], [labels], 2), [[0, 0, 0], [0, 1, 0], [0, 0, 0]])
    half = Detections(torch.tensor([[0.0, 0, 10, 5]]), torch.tensor([0.9]), torch.tensor([0]))  # IoU 0.5
    np.testing.assert_array_equal(confusion_matrix([half], [boxes], [labels], 2, iou=0.5),
                                  [[0, 0, 1], [0, 0, 0], [0, 1, 0]])
    np.testing.assert_array_equal(confusion_matrix([half], [boxes], [labels], 2, iou=0.45),
                                  [[0, 1, 0], [0, 0, 0], [0, 0, 0]])
