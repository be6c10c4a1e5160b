"""The task-aligned assignment per point, padded per image (a test helper over ``assign_rows``).

``TaskAlignedAssigner.assign_rows`` is what the loss runs; these two views of its result per
point, sparse (``point_targets``) and dense with the soft class targets (``dense_assignment``,
the form other implementations return), let tests compare it with a reference and check its
invariants.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from yolokit.losses import TaskAlignedAssigner


class PointTargets(NamedTuple):
    """Per point: its GT's box, class and soft target weight, whether it is foreground, its GT index."""

    boxes: Tensor       # [B, P, 4] xyxy box of the point's GT (meaningful where foreground)
    labels: Tensor      # [B, P] int64 class of the point's GT (meaningful where foreground)
    weights: Tensor     # [B, P] normalized alignment at foreground points, 0 elsewhere
    foreground: Tensor  # [B, P] bool
    gt_index: Tensor    # [B, P] int64 index of the point's GT in [0, G) (0 at background)


class TaskAlignment(NamedTuple):
    """``PointTargets`` with the soft class targets dense: Tensor[B, P, C] ``scores``."""

    boxes: Tensor
    scores: Tensor
    foreground: Tensor
    gt_index: Tensor


@torch.no_grad()
def point_targets(tal: TaskAlignedAssigner, pred_scores: Tensor, pred_boxes: Tensor, points: Tensor,
                  gt_labels: Tensor, gt_boxes: Tensor, gt_mask: Tensor, *, logits: bool = False) -> PointTargets:
    """``tal.assign_rows`` on padded GT (Tensor[B, G] labels and mask, Tensor[B, G, 4] boxes), per point."""
    b, p, _ = pred_scores.shape
    g, device = gt_boxes.shape[1], pred_scores.device
    if g == 0:
        zeros = torch.zeros(b, p, dtype=torch.long, device=device)
        return PointTargets(pred_boxes.new_zeros(b, p, 4, dtype=torch.float32), zeros,
                            pred_boxes.new_zeros(b, p, dtype=torch.float32), zeros.bool(), zeros)
    image = torch.arange(b, device=device)[:, None]
    gt_boxes, gt_labels = gt_boxes.float(), gt_labels.long()
    rows = tal.assign_rows(pred_scores, pred_boxes, points, image.expand(b, g).reshape(-1), gt_labels.reshape(-1),
                           gt_boxes.reshape(-1, 4), gt_mask.reshape(-1), per_image=g, logits=logits)
    foreground = rows.point_row < b * g
    gt_index = torch.where(foreground, rows.point_row - image * g, 0)  # row = image * G + index
    labels = gt_labels.gather(1, gt_index)
    boxes = gt_boxes.gather(1, gt_index[..., None].expand(b, p, 4))
    return PointTargets(boxes, labels, rows.point_weights, foreground, gt_index)


@torch.no_grad()
def dense_assignment(tal: TaskAlignedAssigner, pred_scores: Tensor, pred_boxes: Tensor, points: Tensor,
                     gt_labels: Tensor, gt_boxes: Tensor, gt_mask: Tensor) -> TaskAlignment:
    """``point_targets`` with the soft targets scattered on each GT's class (probabilities in)."""
    t = point_targets(tal, pred_scores, pred_boxes, points, gt_labels, gt_boxes, gt_mask)
    b, p, c = pred_scores.shape
    scores = t.weights.new_zeros(b, p, c).scatter_(-1, t.labels[..., None], t.weights[..., None])
    return TaskAlignment(t.boxes, scores, t.foreground, t.gt_index)
