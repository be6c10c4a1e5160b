"""Who trains what: padding flat targets per image, YOLOv8's task-aligned assigner, and
YOLOv3's single-best-anchor matcher.

Everything here works on whole batches at once (no Python loop over images or boxes)
and without gradients: assignment is a decision about targets, not part of the loss.
Boxes are ``xyxy`` in input pixels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from yolokit.ops.boxes import ciou


class PaddedTargets(NamedTuple):
    """Ground truth of a batch padded to the busiest image.

    Attributes:
        labels: Tensor[B, G] int64 class indices (0 where padding).
        boxes: Tensor[B, G, 4] float32 xyxy in input pixels (0 where padding).
        mask: Tensor[B, G] bool, True for real boxes.
    """

    labels: Tensor
    boxes: Tensor
    mask: Tensor


def pad_targets(targets: Tensor, batch_size: int) -> PaddedTargets:
    """Splits flat batch targets into per-image padded tensors, without a loop.

    Args:
        targets: Tensor[N, 6] rows ``(image_index, class, x1, y1, x2, y2)`` in input pixels.
        batch_size: number of images B; every image index must lie in [0, B).

    Returns:
        ``PaddedTargets`` with G = the largest number of boxes in one image (0 when N = 0).
        Within an image, boxes keep the order they have in ``targets``.

    Example:
        >>> t = torch.tensor([[1, 2, 0, 0, 4, 4], [1, 0, 1, 1, 2, 2.0]])
        >>> p = pad_targets(t, 3)
        >>> p.boxes.shape, p.mask.tolist()
        (torch.Size([3, 2, 4]), [[False, False], [True, True], [False, False]])
    """
    if targets.ndim != 2 or targets.shape[1] != 6:
        raise ValueError(f"targets must be Tensor[N, 6], got shape {tuple(targets.shape)}")
    device = targets.device
    image = targets[:, 0].long()
    counts = torch.bincount(image, minlength=batch_size)
    if counts.numel() > batch_size:
        raise ValueError(f"targets name image index {counts.numel() - 1} but the batch holds {batch_size} images")
    g = int(counts.max()) if targets.shape[0] else 0
    labels = torch.zeros(batch_size, g, dtype=torch.long, device=device)
    boxes = torch.zeros(batch_size, g, 4, dtype=torch.float32, device=device)
    mask = torch.zeros(batch_size, g, dtype=torch.bool, device=device)
    if g:
        image_sorted, order = torch.sort(image, stable=True)
        starts = counts.cumsum(0) - counts
        slot = torch.arange(image.numel(), device=device) - starts[image_sorted]
        rows = targets[order].float()
        labels[image_sorted, slot] = rows[:, 1].long()
        boxes[image_sorted, slot] = rows[:, 2:6]
        mask[image_sorted, slot] = True
    return PaddedTargets(labels, boxes, mask)


class TaskAlignment(NamedTuple):
    """What ``TaskAlignedAssigner`` decided for every point.

    Attributes:
        boxes: Tensor[B, P, 4] xyxy box of the point's GT (meaningful where ``foreground``).
        scores: Tensor[B, P, C] soft class targets: the normalized alignment on the GT's
            class at foreground points, 0 everywhere else.
        foreground: Tensor[B, P] bool, True at points assigned to a GT.
        gt_index: Tensor[B, P] int64 index of the point's GT in [0, G) (0 at background).
    """

    boxes: Tensor
    scores: Tensor
    foreground: Tensor
    gt_index: Tensor


class PointTargets(NamedTuple):
    """``TaskAlignment`` without the dense Tensor[B, P, C] of soft class targets.

    Attributes:
        boxes: Tensor[B, P, 4] xyxy box of the point's GT (meaningful where ``foreground``).
        labels: Tensor[B, P] int64 class of the point's GT (meaningful where ``foreground``).
        weights: Tensor[B, P] the soft class target on that class: the normalized alignment
            at foreground points, 0 elsewhere (``TaskAlignment.scores`` summed over classes).
        foreground: Tensor[B, P] bool, True at points assigned to a GT.
        gt_index: Tensor[B, P] int64 index of the point's GT in [0, G) (0 at background).
    """

    boxes: Tensor
    labels: Tensor
    weights: Tensor
    foreground: Tensor
    gt_index: Tensor


class TaskAlignedAssigner(nn.Module):
    """YOLOv8's task-aligned assigner (TOOD, Feng et al. 2021), over padded batches.

    For each GT box g and point p whose centre lies strictly inside g:
    ``t = s^alpha * u^beta`` with s the predicted score of g's class at p and u the CIoU
    (clamped at 0) of p's predicted box with g. Each GT keeps its ``topk`` candidates
    by t; a point kept by several GTs goes to the one with the highest u (ties to the
    lower GT index). The target score of a positive point on its GT's class is
    ``t * max(u over the GT's positives) / (max(t over the GT's positives) + eps)``.

    Unlike Ultralytics, top-k ranks only the points inside the GT (so a GT with fewer
    than ``topk`` points inside keeps them all) and a contested point goes to the best
    of the GTs that kept it, never to a GT that did not.

    Args:
        topk: candidates kept per GT.
        alpha: exponent of the classification score in the alignment metric.
        beta: exponent of the IoU in the alignment metric.
        eps: strictness of "inside" (pixels) and guard of the normalizing division.
    """

    def __init__(self, topk: int = 10, alpha: float = 0.5, beta: float = 6.0, eps: float = 1e-9):
        super().__init__()
        self.topk, self.alpha, self.beta, self.eps = topk, alpha, beta, eps

    def extra_repr(self) -> str:
        return f"topk={self.topk}, alpha={self.alpha}, beta={self.beta}"

    @torch.no_grad()
    def forward(
        self,
        pred_scores: Tensor,
        pred_boxes: Tensor,
        points: Tensor,
        gt_labels: Tensor,
        gt_boxes: Tensor,
        gt_mask: Tensor,
    ) -> TaskAlignment:
        """Assigns points to GT boxes.

        Args:
            pred_scores: Tensor[B, P, C] predicted class probabilities (after sigmoid).
            pred_boxes: Tensor[B, P, 4] decoded predicted boxes, xyxy pixels.
            points: Tensor[P, 2] (x, y) of each point in pixels.
            gt_labels: Tensor[B, G] int64 classes.
            gt_boxes: Tensor[B, G, 4] xyxy pixels.
            gt_mask: Tensor[B, G] bool, True for real (not padding) boxes.

        Returns:
            ``TaskAlignment`` (float32 boxes and scores).
        """
        t = self.point_targets(pred_scores, pred_boxes, points, gt_labels, gt_boxes, gt_mask)
        b, p, c = pred_scores.shape
        scores = t.weights.new_zeros(b, p, c).scatter_(-1, t.labels[..., None], t.weights[..., None])
        return TaskAlignment(t.boxes, scores, t.foreground, t.gt_index)

    @torch.no_grad()
    def point_targets(
        self,
        pred_scores: Tensor,
        pred_boxes: Tensor,
        points: Tensor,
        gt_labels: Tensor,
        gt_boxes: Tensor,
        gt_mask: Tensor,
        *,
        logits: bool = False,
    ) -> PointTargets:
        """The assignment of ``forward`` in sparse form, without the dense class targets.

        Args:
            pred_scores: Tensor[B, P, C] class probabilities, or class logits with
                ``logits=True`` (any strides: only the scores of candidate pairs are read,
                and with logits only they go through the sigmoid).
            pred_boxes, points, gt_labels, gt_boxes, gt_mask: as in ``forward``.
            logits: ``pred_scores`` holds logits.

        Returns:
            ``PointTargets`` (float32 boxes and weights).
        """
        b, p, _ = pred_scores.shape
        g = gt_boxes.shape[1]
        device = pred_scores.device
        pred_boxes, gt_boxes = pred_boxes.float(), gt_boxes.float()
        if g == 0:
            return PointTargets(
                pred_boxes.new_zeros(b, p, 4),
                torch.zeros(b, p, dtype=torch.long, device=device),
                pred_boxes.new_zeros(b, p),
                torch.zeros(b, p, dtype=torch.bool, device=device),
                torch.zeros(b, p, dtype=torch.long, device=device),
            )
        candidates = self._inside(points.float(), gt_boxes) & gt_mask.bool()[:, :, None]  # [B, G, P]
        overlaps, align = self._alignment(pred_scores, pred_boxes, gt_labels, gt_boxes, candidates, logits)

        k = min(self.topk, p)
        top = align.masked_fill(~candidates, -1.0).topk(k, dim=-1).indices  # [B, G, k]
        kept = torch.zeros_like(candidates).scatter_(-1, top, True).logical_and_(candidates)

        # One GT per point: among the GTs that kept it, the highest overlap.
        gt_index = overlaps.masked_fill(~kept, -1.0).max(dim=1).indices  # [B, P]; faster than argmax
        kept &= torch.arange(g, device=kept.device)[None, :, None] == gt_index[:, None, :]
        foreground = kept.any(dim=1)

        align.masked_fill_(~kept, 0.0)
        overlaps.masked_fill_(~kept, 0.0)
        max_align = align.amax(dim=-1)  # [B, G] over each GT's positives
        max_overlap = overlaps.amax(dim=-1)
        own_align = align.gather(1, gt_index[:, None]).squeeze(1)  # [B, P]
        norm = own_align * (max_overlap / (max_align + self.eps)).gather(1, gt_index)

        labels = gt_labels.long().gather(1, gt_index)
        boxes = gt_boxes.gather(1, gt_index[..., None].expand(b, p, 4))
        return PointTargets(boxes, labels, norm * foreground, foreground, gt_index)

    def _inside(self, points: Tensor, gt_boxes: Tensor) -> Tensor:
        """Tensor[B, G, P] bool: point strictly inside the box (by more than eps)."""
        x, y = points[:, 0], points[:, 1]
        x1, y1, x2, y2 = (v[..., None] for v in gt_boxes.unbind(-1))
        eps = self.eps
        return (x > x1 + eps) & (y > y1 + eps) & (x < x2 - eps) & (y < y2 - eps)

    def _alignment(
        self, pred_scores: Tensor, pred_boxes: Tensor, gt_labels: Tensor, gt_boxes: Tensor, candidates: Tensor,
        logits: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """(u, t): Tensor[B, G, P] clamped CIoU and alignment metric, 0 off the candidates."""
        b, g, p = candidates.shape
        bi, gi, pi = candidates.nonzero(as_tuple=True)  # work only on the candidates
        u = ciou(pred_boxes[bi, pi], gt_boxes[bi, gi]).clamp(min=0)
        s = pred_scores[bi, pi, gt_labels.long()[bi, gi]].float()  # score of the GT's class
        if logits:
            s = s.sigmoid()
        overlaps = pred_boxes.new_zeros(b, g, p)
        overlaps[bi, gi, pi] = u
        align = pred_boxes.new_zeros(b, g, p)
        align[bi, gi, pi] = s.pow(self.alpha) * u.pow(self.beta)
        return overlaps, align


class AnchorMatch(NamedTuple):
    """Where each GT box trains, flat over the batch (one row per real GT).

    Attributes:
        image: Tensor[N] int64 image index.
        level: Tensor[N] int64 pyramid level of the chosen anchor.
        anchor: Tensor[N] int64 anchor index within its level.
        cell_x: Tensor[N] int64 column of the cell holding the box centre at that level.
        cell_y: Tensor[N] int64 row of that cell.
        flat_anchor: Tensor[N] int64 index into the flattened list of all anchors.
    """

    image: Tensor
    level: Tensor
    anchor: Tensor
    cell_x: Tensor
    cell_y: Tensor
    flat_anchor: Tensor


def wh_iou(wh1: Tensor, wh2: Tensor) -> Tensor:
    """IoU of boxes sharing one centre, from their sizes.

    Args:
        wh1: Tensor[N, 2] (w, h).
        wh2: Tensor[M, 2] (w, h).

    Returns:
        Tensor[N, M].
    """
    wh1, wh2 = wh1.float()[:, None], wh2.float()[None]
    inter = torch.minimum(wh1, wh2).clamp(min=0).prod(-1)
    return inter / (wh1.clamp(min=0).prod(-1) + wh2.prod(-1) - inter + 1e-9)


class AnchorMatcher(nn.Module):
    """YOLOv3's (Darknet's) matcher: each GT goes to the one anchor, over all levels,
    whose size best overlaps its own (IoU of centred boxes), at the cell holding its centre.

    Anchors are taken as the flattened list of every level's anchors; when one size
    appears at two levels (yolov3-tiny repeats (81, 82)) the first occurrence, the finer
    level, wins. Centres outside the image are clamped to the border cells.

    Args:
        anchors: per level, the (w, h) of its anchors in input pixels.
        strides: stride of each level in input pixels.
    """

    def __init__(self, anchors: Sequence[Sequence[tuple[float, float]]], strides: Sequence[int]):
        super().__init__()
        if len(anchors) != len(strides):
            raise ValueError(f"{len(anchors)} anchor groups for {len(strides)} levels")
        self.strides = tuple(int(s) for s in strides)
        self.num_anchors = tuple(len(a) for a in anchors)
        self.anchors = tuple(tuple((float(w), float(h)) for w, h in level) for level in anchors)

    def extra_repr(self) -> str:
        return f"anchors={self.anchors}, strides={self.strides}"

    @torch.no_grad()
    def forward(self, targets: Tensor, shapes: Sequence[tuple[int, int]]) -> AnchorMatch:
        """Matches every target row to an anchor and a cell.

        Args:
            targets: Tensor[N, 6] rows ``(image_index, class, x1, y1, x2, y2)`` in pixels.
            shapes: (height, width) of each level's map.

        Returns:
            ``AnchorMatch`` with one row per target row, in the same order.
        """
        device = targets.device
        flat = [(lvl, j, wh) for lvl, level in enumerate(self.anchors) for j, wh in enumerate(level)]
        anchor_wh = torch.tensor([wh for _, _, wh in flat], device=device)  # [sum A, 2]
        anchor_level = torch.tensor([lvl for lvl, _, _ in flat], device=device)
        anchor_index = torch.tensor([j for _, j, _ in flat], device=device)

        boxes = targets[:, 2:6].float()
        centre = (boxes[:, :2] + boxes[:, 2:]) / 2
        best = wh_iou(boxes[:, 2:] - boxes[:, :2], anchor_wh).argmax(dim=1)  # first maximum wins
        level = anchor_level[best]
        stride = torch.tensor(self.strides, dtype=torch.float32, device=device)[level]
        size = torch.tensor(list(shapes), dtype=torch.float32, device=device)[level]  # (h, w)
        cell = (centre / stride[:, None]).floor()
        cell_x = torch.minimum(cell[:, 0].clamp(min=0), size[:, 1] - 1).long()
        cell_y = torch.minimum(cell[:, 1].clamp(min=0), size[:, 0] - 1).long()
        return AnchorMatch(targets[:, 0].long(), level, anchor_index[best], cell_x, cell_y, best)
