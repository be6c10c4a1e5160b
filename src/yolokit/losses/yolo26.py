"""YOLO26's end-to-end detection loss: a one-to-many and a one-to-one branch, weighted by epoch.

The end-to-end head trains two heads on the same features. The one-to-many branch is a
YOLOv8-style loss whose assigner keeps 10 points per GT; the one-to-one branch keeps 7
candidates and then one point per GT, so that the head it trains needs no NMS. Early epochs
lean on the dense branch, later ones on the one-to-one branch:

    total = o2m * L_one2many + o2o * L_one2one,  o2m from 0.8 down to 0.1 over the run, o2o = 1 - o2m.

Each branch's L = box + cls + l1 (the gains applied): CIoU, BCE on every point, and with a
``reg_max = 1`` head (raw distances, no distribution) an L1 term on the image-size-normalized
distances in place of DFL. The numbers are Ultralytics 8.4's (``E2ELoss``), divided by the batch
size: see :class:`YOLO26Loss`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from yolokit.losses.assigners import MaskInputs, RowAssignment, TaskAlignedAssigner, widening_side
from yolokit.losses.base import DetectionLoss, as_padded
from yolokit.losses.pairwise import ciou_unclamped
from yolokit.losses.yolov8 import distribution_focal_loss
from yolokit.ops.anchors import box_to_dist, dfl_expectation, dist_to_box, grid_points
from yolokit.ops.pick import pick

BRANCHES = ("one2many", "one2one")


def branch_weights(epoch: int, epochs: int, *, start: float = 0.8, final: float = 0.1) -> tuple[float, float]:
    """``(o2m, o2o)``: the weights of the two branches during epoch ``epoch`` (0-based) of ``epochs``.

    The one-to-many weight falls linearly from ``start`` at epoch 0 to ``final`` at the last epoch
    (``epochs - 1``) and stays there; ``o2o = max(1 - o2m, 0)``. A pure function of the epoch, so a
    resumed run gets its epoch's weights without replaying the past.

    Ultralytics keeps a counter instead: ``E2ELoss.update()`` runs after every epoch (``updates``
    is then the number of epochs done) and sets ``o2m = decay(updates)``; a resume at
    ``start_epoch`` sets ``updates = start_epoch - 1`` and calls ``update()`` once. Either way the
    steps of epoch ``e`` run with ``decay(e)`` (epoch 0 with the initial 0.8), which is what this
    returns, to the last bit of the double.

    Examples:
        >>> branch_weights(0, 10)
        (0.8, 0.19999999999999996)
        >>> branch_weights(9, 10)[0]
        0.1
    """
    if epoch <= 0:   # the criterion's initial state, before any update()
        return start, max(1.0 - start, 0.0)
    o2m = max(1 - epoch / max(epochs - 1, 1), 0) * (start - final) + final
    return o2m, max(1.0 - o2m, 0.0)


class YOLO26BranchLoss(DetectionLoss):
    """The loss of one branch of an end-to-end head (as Ultralytics 8.4's ``v8DetectionLoss``).

    Each level map is Tensor[B, 4 * reg_max + C, H_l, W_l]. With ``reg_max = 1`` the first four
    channels are the raw distances (left, top, right, bottom) from the cell centre to the box's
    sides in stride units, without an activation (they may be negative); with ``reg_max > 1``
    they are per side bin logits as in :class:`~yolokit.losses.YOLOv8Loss`. Then C class logits.

    The points are assigned by a :class:`TaskAlignedAssigner` (``topk``, ``topk2``, GT sides
    below ``min_gt_side`` widened for the inside test). With S = max(sum of target scores, 1)
    and w a foreground point's target score:

    - ``box`` = sum over foreground of (1 - CIoU(pred, target)) * w / S, in stride units and by
      :func:`ciou_unclamped` (an inverted predicted box counts as Ultralytics counts it);
    - ``cls`` = BCE-with-logits summed over every point and class / S;
    - ``l1`` (reg_max 1) = sum over foreground of mean over the 4 sides of
      |pred - target distance|, both in pixels divided by the input width (left, right) or height
      (top, bottom), times w, / S. The input size is the first level's size times its stride;
    - ``dfl`` (reg_max > 1) in place of ``l1``: the distribution focal loss of ``YOLOv8Loss``.

    ``total = box * box_gain + cls * cls_gain + (l1 | dfl) * dfl_gain``, per batch (not times the
    batch size as in Ultralytics). Float32 outside autocast; nothing read back from the device.

    Args:
        num_classes: number of classes C.
        strides: stride of each level in input pixels, in the maps' order.
        reg_max: 1 for raw distances, else bins per side.
        box: gain of the CIoU term.
        cls: gain of the classification term.
        dfl: gain of the L1 (reg_max 1) or distribution focal term.
        topk: candidates kept per GT by the assigner.
        topk2: positives kept per GT once contested points are settled (None: all).
        alpha: assigner's score exponent.
        beta: assigner's IoU exponent.
        min_gt_side: shortest GT side of the assigner's inside test; None: Ultralytics' choice,
            the second level's stride (:func:`~yolokit.losses.assigners.widening_side`).
    """

    channel_layout, takes_padded_targets = "4 * reg_max + C", True

    def __init__(
        self,
        num_classes: int,
        strides: Sequence[int],
        reg_max: int = 1,
        box: float = 7.5,
        cls: float = 0.5,
        dfl: float = 1.5,
        topk: int = 10,
        topk2: int | None = None,
        alpha: float = 0.5,
        beta: float = 6.0,
        min_gt_side: float | None = None,
    ):
        super().__init__()
        if reg_max < 1:
            raise ValueError(f"reg_max must be >= 1, got {reg_max}")
        self.num_classes, self.strides, self.reg_max = num_classes, tuple(int(s) for s in strides), reg_max
        self.distance_term = "l1" if reg_max == 1 else "dfl"
        self.gains = {"box": box, "cls": cls, self.distance_term: dfl}
        side = widening_side(self.strides) if min_gt_side is None else min_gt_side
        self.assigner = TaskAlignedAssigner(topk=topk, alpha=alpha, beta=beta, topk2=topk2, min_gt_side=side,
                                            contested="any")

    def extra_repr(self) -> str:
        gains = ", ".join(f"{k}={v}" for k, v in self.gains.items())
        return f"num_classes={self.num_classes}, strides={self.strides}, reg_max={self.reg_max}, {gains}"

    def map_channels(self) -> list[int]:
        return [4 * self.reg_max + self.num_classes] * len(self.strides)

    def _predictions(self, maps: list[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """``(box_out, cls_logits, points, point_strides, distances)``: the box channels
        Tensor[B, 4, P] (reg_max 1) or Tensor[B, 4, R, P], class logits Tensor[B, C, P], the points
        Tensor[P, 2] in stride units and their strides Tensor[P], the distances Tensor[B, P, 4] in
        stride units (detached for reg_max > 1: the expectation is recomputed where needed)."""
        b, r, c = maps[0].shape[0], self.reg_max, self.num_classes
        box_parts, cls_parts = zip(*(m.flatten(2).split((4 * r, c), dim=1) for m in maps), strict=True)
        p = sum(x.shape[-1] for x in box_parts)
        box_out = torch.cat(box_parts, dim=2)
        if r > 1:
            box_out = box_out.view(b, 4, r, p)
        points, point_strides = grid_points([tuple(m.shape[-2:]) for m in maps], self.strides, device=maps[0].device)
        with torch.no_grad():
            dist = box_out if r == 1 else dfl_expectation(box_out, dim=-2)
        return box_out, torch.cat(cls_parts, dim=2), points / point_strides[:, None], point_strides, \
            dist.detach().transpose(1, 2)

    def _assign(self, cls_logits: Tensor, dist: Tensor, points: Tensor, point_strides: Tensor, targets: Tensor,
                max_boxes: int | None, masks: Callable[[tuple], MaskInputs] | None = None
                ) -> tuple[RowAssignment, tuple]:
        b = cls_logits.shape[0]
        stride = point_strides[:, None]
        pred_boxes = dist_to_box(dist, points) * stride  # pixels, as Ultralytics scales its stride-unit boxes
        if max_boxes is None:  # the targets' rows as they come: nothing to read back
            gt = (targets[:, 0].long(), targets[:, 1].long(), targets[:, 2:6], None)
        else:
            gt = as_padded(targets, b, max_boxes).rows()
        assigned = self.assigner.assign_rows(cls_logits.transpose(1, 2), pred_boxes, points * stride, *gt,
                                             per_image=max_boxes, logits=True,
                                             masks=None if masks is None else masks(gt))
        return assigned, gt

    @torch.no_grad()
    def assignment(self, maps: Sequence[Tensor], targets: Tensor, *, max_boxes: int | None = None) -> RowAssignment:
        """The assigner's decision on these maps and targets (what ``forward`` trains on).

        The rows are ``targets``' own (max_boxes None) or padded per image, image-major (row =
        image * max_boxes + slot, as ``pad_targets(...).rows()``).
        """
        maps = [m.float() for m in maps]
        _, cls_logits, points, point_strides, dist = self._predictions(maps)
        return self._assign(cls_logits, dist, points, point_strides, targets.float(), max_boxes)[0]

    def _loss(self, maps: list[Tensor], targets: Tensor, max_boxes: int | None) -> tuple[Tensor, dict[str, Tensor]]:
        parts, _, _ = self._terms(maps, targets, max_boxes)
        total = parts["box"] + parts["cls"] + parts[self.distance_term]
        return total, {k: v.detach() for k, v in parts.items()}

    def _terms(self, maps: list[Tensor], targets: Tensor, max_boxes: int | None,
               masks: Callable[[tuple], MaskInputs] | None = None) -> tuple[dict[str, Tensor], RowAssignment, tuple]:
        """The three terms (gains applied, with gradient), the assignment and the GT rows it assigned
        ``(image, label, box, valid or None)``. ``masks``: the assigner's mask inputs for those rows
        (YOLO26-seg), made once the rows are known."""
        r = self.reg_max
        box_out, cls_logits, points, point_strides, dist = self._predictions(maps)
        with torch.no_grad():  # the assigner sees every point; gradients flow only where it assigns
            assigned, gt = self._assign(cls_logits, dist, points, point_strides, targets, max_boxes, masks)
            fg_image, fg_point, fg_label, target, weight = _every_point(assigned, *gt[:3])
        score_sum = weight.sum().clamp(min=1.0)
        # BCE-with-logits summed over every point and class against `weight` on the GT class of foreground
        # points, 0 elsewhere: sum softplus(x) - sum x * target (pick: a backward without a host wait)
        fg_cls_logits = pick(cls_logits, fg_image, fg_label, fg_point)
        cls = (F.softplus(cls_logits).sum() - (fg_cls_logits * weight).sum()) / score_sum

        fg_stride = point_strides[fg_point, None]
        fg_points = points[fg_point]
        target = target / fg_stride  # stride units, as the box term compares them
        if r == 1:
            fg_dist = pick(box_out, fg_image, None, fg_point)  # [M, 4]
        else:
            fg_logits = pick(box_out, fg_image, None, None, fg_point)  # [M, 4, R]
            fg_dist = dfl_expectation(fg_logits)
        # every point of the batch is here, background with weight 0: its boxes are swapped for a unit square,
        # so that a degenerate pair (an inverted box of zero union) cannot make 0 * NaN of the sums or gradients
        trained = (weight > 0)[:, None]
        unit = (torch.arange(4, device=target.device) >= 2).float()  # (0, 0, 1, 1)
        pred = torch.where(trained, dist_to_box(fg_dist, fg_points), unit)
        box = ((1.0 - ciou_unclamped(pred, torch.where(trained, target, unit))) * weight).sum() / score_sum
        if r == 1:
            height, width = (n * self.strides[0] for n in maps[0].shape[-2:])
            error = (_per_image_size(fg_dist * fg_stride, width, height)
                     - _per_image_size(box_to_dist(target, fg_points) * fg_stride, width, height)).abs()
            distance = (error.mean(-1) * weight).sum() / score_sum
        else:
            target_dist = box_to_dist(target, fg_points, max_dist=r - 1 - 0.01)
            distance = (distribution_focal_loss(fg_logits, target_dist) * weight).sum() / score_sum

        parts = {"box": box * self.gains["box"], "cls": cls * self.gains["cls"],
                 self.distance_term: distance * self.gains[self.distance_term]}
        return parts, assigned, gt


def _every_point(assigned: RowAssignment, image: Tensor, labels: Tensor,
                 boxes: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Every point of the batch with its GT's class and box and its weight (0 at background), flat
    Tensor[B * P]: the per-point form of the assignment, complete with ``contested="any"``.

    Returns:
        ``(image, point, label, box, weight)``: Tensor[M] int64 image, point and class,
        Tensor[M, 4] the GT box, Tensor[M] float32 weight, M = B * P.
    """
    (b, p), n, device = assigned.point_row.shape, labels.shape[0], labels.device
    point_row = assigned.point_row.reshape(-1)
    row = torch.where(point_row < n, point_row, 0)
    image = torch.arange(b, device=device).repeat_interleave(p)
    point, weight = torch.arange(p, device=device).repeat(b), assigned.point_weights.reshape(-1)
    if n == 0:   # no GT in the batch: nothing to take a class or a box from (every weight is 0)
        return image, point, torch.zeros_like(point), weight.new_zeros(b * p, 4), weight
    return image, point, labels[row], boxes[row], weight


def _per_image_size(ltrb: Tensor, width: float, height: float) -> Tensor:
    """Tensor[M, 4] (left, top, right, bottom) pixels divided by the width (left, right) or height."""
    return torch.stack((ltrb[:, 0::2] / width, ltrb[:, 1::2] / height), dim=-1).flatten(1)


class YOLO26Loss(nn.Module):
    """YOLO26's loss (Ultralytics 8.4's ``E2ELoss``) on the raw maps of an end-to-end head.

    ``forward(maps, targets)`` takes the head's training output, a dict
    ``{"one2many": [maps...], "one2one": [maps...]}`` with one Tensor[B, 4 * reg_max + C, H_l, W_l]
    per level, levels in ``strides`` order (see :class:`YOLO26BranchLoss` for the channels), and
    returns

        total = o2m * L_one2many + o2o * L_one2one

    where each L is its branch's box + cls + l1 (gains applied), the one-to-many branch assigned
    with ``topk=10`` and the one-to-one branch with ``topk=7, topk2=1``, both widening GT sides
    below the second level's stride for the inside test.

    The weights follow the epoch: call :meth:`set_epoch` at the start of every epoch (and once
    when resuming, before the first step); until then they are epoch 0's, (0.8, 0.2). They are
    Python floats (``epoch_weights``), as in Ultralytics: nothing to move to the device, nothing
    read back; a loss compiled with dynamic sizes (as the trainer compiles it) traces them as
    symbolic floats, so a new epoch's weights do not recompile it.

    ``parts``: the **one-to-one** branch's ``box``, ``cls`` and ``l1`` (``dfl`` for reg_max > 1),
    gains applied, not weighted by o2o: what Ultralytics reports as ``box_loss``, ``cls_loss``,
    ``l1_loss`` (per batch, as theirs). They do not sum to ``total``: the branch totals are
    :meth:`branch_losses`'.

    Scale: each branch is normalized per batch (by its sum of target scores), as in
    :class:`~yolokit.losses.YOLOv8Loss`: Ultralytics' loss (the trainer's ``loss.sum()``) is this
    total times the batch size. With plain SGD, an Ultralytics learning rate ``lr`` therefore
    matches ours at ``lr * batch_size``; Adam(W) hardly notices the scale.

    Args:
        num_classes: number of classes C.
        strides: stride of each level in input pixels, in the maps' order.
        reg_max: 1 (YOLO26: raw distances and the L1 term), or bins per side (DFL).
        box: gain of the CIoU term.
        cls: gain of the classification term.
        dfl: gain of the L1 (or DFL) term.
        topk: the one-to-many branch's candidates per GT.
        one2one_topk: the one-to-one branch's candidates per GT.
        one2one_topk2: the one-to-one branch's positives per GT.
        start: o2m at epoch 0.
        final: o2m at the last epoch.
        min_gt_side: both branches' (:class:`YOLO26BranchLoss`); None: the reference's widening.

    Examples:
        >>> loss_fn = YOLO26Loss(num_classes=3, strides=(8, 16, 32))
        >>> maps = {k: [torch.randn(2, 7, s, s) for s in (8, 4, 2)] for k in ("one2many", "one2one")}
        >>> loss_fn.set_epoch(0, epochs=100)   # at the start of every epoch
        (0.8, 0.19999999999999996)
        >>> total, parts = loss_fn(maps, torch.tensor([[0, 1, 8.0, 8.0, 40.0, 30.0]]))
        >>> sorted(parts)
        ['box', 'cls', 'l1']
    """

    def __init__(
        self,
        num_classes: int,
        strides: Sequence[int],
        reg_max: int = 1,
        box: float = 7.5,
        cls: float = 0.5,
        dfl: float = 1.5,
        topk: int = 10,
        one2one_topk: int = 7,
        one2one_topk2: int = 1,
        start: float = 0.8,
        final: float = 0.1,
        min_gt_side: float | None = None,
    ):
        super().__init__()
        common = {"num_classes": num_classes, "strides": strides, "reg_max": reg_max, "box": box, "cls": cls,
                  "dfl": dfl, "min_gt_side": min_gt_side}
        self.one2many = YOLO26BranchLoss(**common, topk=topk)
        self.one2one = YOLO26BranchLoss(**common, topk=one2one_topk, topk2=one2one_topk2)
        self.num_classes, self.strides, self.reg_max = num_classes, self.one2many.strides, reg_max
        self.start, self.final, self.epoch_weights = start, final, branch_weights(0, 1, start=start, final=final)

    takes_padded_targets = True   # PaddedTargets pass to both branches (a CUDA graph's static shapes)

    def baked_numbers(self) -> tuple[float, ...]:   # what a recorded step holds to (yolokit.accel.graphs)
        return tuple(self.epoch_weights)

    def extra_repr(self) -> str:
        o2m, o2o = self.epoch_weights
        return f"o2m={o2m:.4f}, o2o={o2o:.4f} (from {self.start} to {self.final})"

    @property
    def gains(self) -> dict[str, float]:
        return self.one2one.gains

    def set_epoch(self, epoch: int, epochs: int) -> tuple[float, float]:
        """Sets the branch weights for the steps of epoch ``epoch`` (0-based) of ``epochs``.

        Call it at the start of every epoch, before its first step, and once on resume with the
        epoch the run continues at (it depends on nothing else: no history to replay). Matches
        Ultralytics' ``update()`` after each epoch and its resume (:func:`branch_weights`).

        Returns:
            ``(o2m, o2o)``, Python floats.
        """
        self.epoch_weights = branch_weights(epoch, epochs, start=self.start, final=self.final)
        return self.epoch_weights

    def _check(self, maps: Mapping[str, Sequence[Tensor]]) -> None:
        if not isinstance(maps, Mapping) or set(maps) != set(BRANCHES):
            got = sorted(maps) if isinstance(maps, Mapping) else type(maps).__name__
            raise ValueError(f"YOLO26Loss takes the end-to-end head's dict {{'one2many': [...], 'one2one': [...]}} "
                             f"of per-level maps, got {got}")

    def branch_losses(self, maps: Mapping[str, Sequence[Tensor]], targets: Tensor, *,
                      max_boxes: int | None = None) -> dict[str, tuple[Tensor, dict[str, Tensor]]]:
        """Each branch's unweighted ``(total, parts)`` (gains applied; parts sum to the branch total)."""
        self._check(maps)
        return {name: getattr(self, name)(maps[name], targets, max_boxes=max_boxes) for name in BRANCHES}

    def forward(self, maps: Mapping[str, Sequence[Tensor]], targets: Tensor, *,
                max_boxes: int | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """Loss of one batch, without reading anything back from the device.

        Args:
            maps: ``{"one2many": [...], "one2one": [...]}``, per level Tensor[B, 4 * reg_max + C, H_l, W_l].
            targets: Tensor[N, 6] rows ``(image_index, class, x1, y1, x2, y2)`` in input pixels, on
                the maps' device.
            max_boxes: the most boxes one image holds, when the caller knows it (the targets are then
                padded per image: faster, same result); None: the rows as they come.

        Returns:
            ``(total, parts)``: total = o2m * L_one2many + o2o * L_one2one, a float32 scalar with
            gradient; parts the one-to-one branch's detached float32 ``box``, ``cls``, ``l1`` (or
            ``dfl``), gains applied, not weighted.
        """
        losses = self.branch_losses(maps, targets, max_boxes=max_boxes)
        (many, _), (one, parts) = losses["one2many"], losses["one2one"]
        o2m, o2o = self.epoch_weights
        return many * o2m + one * o2o, parts
