"""YOLOv8's detection loss: task-aligned assignment, then BCE + CIoU + distribution focal loss."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from yolokit.losses.assigners import RowAssignment, TaskAlignedAssigner
from yolokit.losses.base import DetectionLoss, as_padded
from yolokit.ops.anchors import box_to_dist, dfl_expectation, dist_to_box, grid_points
from yolokit.ops.boxes import ciou
from yolokit.ops.pick import pick


class YOLOv8Loss(DetectionLoss):
    """Loss of an anchor-free DFL head (YOLOv8) on its raw maps.

    Each level map is Tensor[B, 4 * reg_max + C, H_l, W_l]: per side (left, top, right,
    bottom) ``reg_max`` logits of a distribution over distances 0 .. reg_max - 1 in
    stride units (side-major channels), then C class logits. The predicted distance is
    the distribution's expectation; the box is ``(point - lt * stride, point + rb * stride)``
    with the point at the cell centre.

    With the ``TaskAlignedAssigner``'s soft targets, S = max(sum of target scores, 1) and
    w = a foreground point's summed target score:

    - ``cls`` = BCE-with-logits summed over every point and class, / S;
    - ``box`` = sum over foreground of (1 - CIoU(pred, target)) * w, / S;
    - ``dfl`` = over foreground, each side's target distance (stride units, clamped to
      [0, reg_max - 1.01]) is split between its two neighbouring bins; the two
      cross-entropies are weighted by proximity, averaged over the sides, times w,
      summed, / S.

    ``total = box * box_term + cls * cls_term + dfl * dfl_term`` (gains 7.5, 0.5, 1.5 by
    default). The total is normalized per batch (by S): unlike Ultralytics it is **not**
    multiplied by the batch size. With plain SGD, an Ultralytics learning rate ``lr``
    therefore matches ours at ``lr * batch_size``; Adam(W) hardly notices the scale. (The trainer
    backpropagates ``loss * images``, as Ultralytics does, so its gradients and their clipping are
    the reference's.)

    A GT box that holds no grid point (a tiny one between cell centres) gets no positives and
    only shapes the class loss as background, as in Ultralytics before 8.4; 8.4 widens a GT's
    sides shorter than its second level's stride (16 px) to it for the assigner's inside test and
    gives a point several GTs kept to the best of all the GTs that hold it: ``min_gt_side=16,
    contested="any"`` here (off by default: five seeds a row on the demo's preset learn alike
    with and without them, BENCHMARKS "The assigner's two details"). Widening alone
    (``contested="kept"``) keeps a widened GT's inside points of alignment 0 as positives of weight
    0, which the mask term of :class:`YOLOv8SegLoss` then trains; 8.4 does not. All loss arithmetic
    runs in float32 with autocast disabled, whatever the maps' dtype.

    Args:
        num_classes: number of classes C.
        strides: stride of each level in input pixels, in the maps' order.
        reg_max: bins per side.
        box: gain of the CIoU term.
        cls: gain of the classification term.
        dfl: gain of the distribution focal term.
        topk: candidates kept per GT by the assigner.
        alpha: assigner's score exponent.
        beta: assigner's IoU exponent.
        min_gt_side: the assigner's inside test widens GT sides shorter than this (pixels) to it about the
            box's centre (``TaskAlignedAssigner``'s); 0: the box as it is.
        contested: who gets a point several GTs kept (``TaskAlignedAssigner``'s): ``"kept"``, the best of
            those; ``"any"``, the best of all that hold it (Ultralytics 8.4's); None: the assigner's default
            (``"kept"``).

    Examples:
        >>> loss_fn = YOLOv8Loss(num_classes=3, strides=(8, 16, 32))
        >>> maps = [torch.randn(2, 67, s, s) for s in (8, 4, 2)]
        >>> targets = torch.tensor([[0, 1, 8.0, 8.0, 40.0, 30.0]])
        >>> total, parts = loss_fn(maps, targets)
        >>> sorted(parts)
        ['box', 'cls', 'dfl']
    """

    def __init__(
        self,
        num_classes: int,
        strides: Sequence[int],
        reg_max: int = 16,
        box: float = 7.5,
        cls: float = 0.5,
        dfl: float = 1.5,
        topk: int = 10,
        alpha: float = 0.5,
        beta: float = 6.0,
        min_gt_side: float = 0.0,
        contested: str | None = None,
    ):
        super().__init__()
        if reg_max < 2:
            raise ValueError(f"reg_max must be >= 2, got {reg_max}")
        self.num_classes, self.strides, self.reg_max = num_classes, tuple(int(s) for s in strides), reg_max
        self.gains = {"box": box, "cls": cls, "dfl": dfl}
        given = {} if contested is None else {"contested": contested}
        self.assigner = TaskAlignedAssigner(topk=topk, alpha=alpha, beta=beta, min_gt_side=min_gt_side, **given)

    def extra_repr(self) -> str:
        gains = ", ".join(f"{k}={v}" for k, v in self.gains.items())
        return f"num_classes={self.num_classes}, strides={self.strides}, reg_max={self.reg_max}, {gains}"

    channel_layout = "4 * reg_max + C"
    takes_padded_targets = True

    def map_channels(self) -> list[int]:
        return [4 * self.reg_max + self.num_classes] * len(self.strides)

    def _loss(self, maps: list[Tensor], targets: Tensor, max_boxes: int | None) -> tuple[Tensor, dict[str, Tensor]]:
        parts, _, _ = self._terms(maps, targets, max_boxes)
        total = parts["box"] + parts["cls"] + parts["dfl"]
        return total, {k: v.detach() for k, v in parts.items()}

    def _terms(self, maps: list[Tensor], targets: Tensor, max_boxes: int | None
               ) -> tuple[dict[str, Tensor], RowAssignment, tuple[Tensor, Tensor, Tensor, Tensor | None]]:
        """The three terms (gains applied, with gradient), the assignment, and the GT rows it assigned
        ``(image, label, box, valid or None)``: what a loss built on this one (segmentation) goes on from."""
        b, r, c = maps[0].shape[0], self.reg_max, self.num_classes
        device = maps[0].device
        box_parts, cls_parts = zip(*(m.flatten(2).split((4 * r, c), dim=1) for m in maps), strict=True)
        p = sum(x.shape[-1] for x in box_parts)
        box_logits = torch.cat(box_parts, dim=2).view(b, 4, r, p)  # [B, side, bin, P]
        cls_logits = torch.cat(cls_parts, dim=2)  # [B, C, P]
        points, point_strides = grid_points([tuple(m.shape[-2:]) for m in maps], self.strides, device=device)

        with torch.no_grad():  # the assigner sees every point; gradients flow only where it assigns
            dist = dfl_expectation(box_logits, dim=-2).transpose(1, 2)  # [B, P, 4] strides
            pred_boxes = dist_to_box(dist * point_strides[:, None], points)
            if max_boxes is None:  # the targets' rows as they come: nothing to read back
                gt = (targets[:, 0].long(), targets[:, 1].long(), targets[:, 2:6], None)
            else:
                gt = as_padded(targets, b, max_boxes).rows()
            assigned = self.assigner.assign_rows(cls_logits.transpose(1, 2), pred_boxes, points, *gt,
                                                 per_image=max_boxes, logits=True)
            fg_image, fg_point, fg_label, target, weight = _training_points(assigned, *gt[:3])
        score_sum = weight.sum().clamp(min=1.0)
        # BCE-with-logits summed over every point and class against targets that are `weight`
        # on the GT class of foreground points and 0 elsewhere: sum softplus(x) - sum x * target.
        # pick, not cls_logits[...]: the backward of advanced indexing sorts on CUDA, which waits for the device
        fg_cls_logits = pick(cls_logits, fg_image, fg_label, fg_point)
        cls = (F.softplus(cls_logits).sum() - (fg_cls_logits * weight).sum()) / score_sum

        fg_logits = pick(box_logits, fg_image, None, None, fg_point)  # [M, 4, R]
        fg_stride = point_strides[fg_point, None]
        fg_points = points[fg_point]
        pred = dist_to_box(dfl_expectation(fg_logits) * fg_stride, fg_points)  # [M, 4] pixels
        box = ((1.0 - ciou(pred, target)) * weight).sum() / score_sum
        target_dist = box_to_dist(target / fg_stride, fg_points / fg_stride, max_dist=r - 1 - 0.01)
        dfl = (distribution_focal_loss(fg_logits, target_dist) * weight).sum() / score_sum

        parts = {"box": box * self.gains["box"], "cls": cls * self.gains["cls"], "dfl": dfl * self.gains["dfl"]}
        return parts, assigned, gt


def _training_points(assigned: RowAssignment, image: Tensor, labels: Tensor,
                     boxes: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The points the box and class terms act on, as many as the shapes say.

    Every foreground point appears exactly once with its weight; other entries carry
    weight 0 (their terms vanish, and so do their gradients). With N GT rows, k kept points
    per GT and B * P points, the entries are the GTs' kept points (N * k of them) when that
    is no more than B * P, else every point: no count is read back from the device.

    Args:
        assigned: ``TaskAlignedAssigner.assign_rows`` of the rows below.
        image, labels: Tensor[N] int64 image and class of each GT row.
        boxes: Tensor[N, 4] xyxy pixels.

    Returns:
        ``(image, point, label, box, weight)``: Tensor[M] int64 image, point and class,
        Tensor[M, 4] the GT box, Tensor[M] float32 weight.
    """
    (n, k), (b, p) = assigned.points.shape, assigned.point_row.shape
    device = image.device
    if n * k <= b * p:  # each GT's kept points
        row = torch.arange(n, device=device).repeat_interleave(k)
        image, point, weight = image[row], assigned.points.reshape(-1), assigned.weights.reshape(-1)
    else:  # every point
        point_row = assigned.point_row.reshape(-1)
        row = torch.where(point_row < n, point_row, 0)
        image = torch.arange(b, device=device).repeat_interleave(p)
        point, weight = torch.arange(p, device=device).repeat(b), assigned.point_weights.reshape(-1)
    return image, point, labels[row], boxes[row], weight


def distribution_focal_loss(logits: Tensor, target: Tensor) -> Tensor:
    """Distribution focal loss (Li et al., GFL 2020) per box, averaged over its sides.

    A target distance t between bins i = floor(t) and i + 1 is the mix
    ``(i + 1 - t) * CE(logits, i) + (t - i) * CE(logits, i + 1)``.

    Args:
        logits: Tensor[N, 4, R] per side bin logits.
        target: Tensor[N, 4] distances in bin units, within [0, R - 1).

    Returns:
        Tensor[N].
    """
    log_probs = logits.float().log_softmax(-1)
    left = target.floor().long()
    w_left = (left + 1).float() - target
    lp_left = log_probs.gather(-1, left[..., None]).squeeze(-1)
    lp_right = log_probs.gather(-1, (left + 1)[..., None]).squeeze(-1)
    return -(lp_left * w_left + lp_right * (1.0 - w_left)).mean(-1)
