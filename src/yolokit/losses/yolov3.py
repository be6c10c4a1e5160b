"""YOLOv3's detection loss with Darknet's semantics: single best anchor, ignore threshold,
objectness and class BCE, and a CIoU (or the paper's squared-error) box loss."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from yolokit.losses.anchor_matcher import AnchorMatcher
from yolokit.losses.base import DetectionLoss, PaddedTargets, pad_targets
from yolokit.ops.anchors import anchor_to_box, grid_points
from yolokit.ops.boxes import ciou
from yolokit.ops.cache import ConstantCache, upload
from yolokit.ops.pick import pick

BOX_LOSSES = ("ciou", "mse")


class YOLOv3Loss(DetectionLoss):
    """Loss of an anchor head (YOLOv3, YOLOv3-SPP, YOLOv3-tiny) on its raw maps.

    Each level map is Tensor[B, A * (5 + C), H_l, W_l], per anchor a the channels
    ``a * (5 + C) + (tx, ty, tw, th, obj, cls_0 .. cls_{C-1})``. Decoding (Darknet's, the
    head's own: ``ops.anchors.anchor_to_box``): centre = (sigmoid(t_xy) + cell) * stride,
    size = exp(t_wh) * anchor, t_wh clamped at ``ops.anchors.MAX_LOG_SCALE``.

    Assignment (Darknet): every GT goes to the single anchor, over all levels, with the
    best width/height IoU, at the cell holding its centre (``AnchorMatcher``).

    - ``box``: per GT, 1 - CIoU of its anchor's decoded box and the GT (``box="ciou"``),
      or the paper's squared error ``(2 - w * h) * ((sigmoid(tx) - tx*)^2 + (sigmoid(ty) -
      ty*)^2 + (tw - tw*)^2 + (th - th*)^2)`` with w, h the GT size as a fraction of the
      image and ``tx* = cx / stride - cell_x``, ``tw* = log(w / anchor_w)`` (``box="mse"``);
    - ``obj``: BCE-with-logits, target 1 at assigned anchors and 0 elsewhere, except that
      unassigned predictions whose decoded box has IoU > ``ignore_thresh`` with some GT of
      their image are left out;
    - ``cls``: BCE-with-logits at assigned anchors over all classes; an anchor taken by
      GTs of several classes has all of them as targets (as Darknet does).

    Each part is summed over the batch and divided by the batch size B (Darknet sums and
    divides its learning rate by the batch instead). Two GTs matched to the same anchor
    and cell both train its box (Darknet keeps the last one written; we keep both, so the
    result does not depend on GT order). ``total = box_gain * box + obj_gain * obj +
    cls_gain * cls``, computed in float32 with autocast disabled.

    Args:
        num_classes: number of classes C.
        anchors: per level, the (w, h) of its anchors in input pixels.
        strides: stride of each level in input pixels, in the maps' order.
        box: "ciou" or "mse".
        ignore_thresh: IoU above which an unassigned prediction gets no objectness loss.
        box_gain: gain of the box term.
        obj_gain: gain of the objectness term.
        cls_gain: gain of the class term.

    Examples:
        >>> anchors = (((23, 27), (37, 58), (81, 82)), ((81, 82), (135, 169), (344, 319)))
        >>> loss_fn = YOLOv3Loss(num_classes=2, anchors=anchors, strides=(16, 32))
        >>> maps = [torch.randn(1, 21, 4, 4), torch.randn(1, 21, 2, 2)]
        >>> total, parts = loss_fn(maps, torch.tensor([[0, 1, 8.0, 8.0, 40.0, 30.0]]))
        >>> sorted(parts)
        ['box', 'cls', 'obj']
    """

    def __init__(
        self,
        num_classes: int,
        anchors: Sequence[Sequence[tuple[float, float]]],
        strides: Sequence[int],
        box: str = "ciou",
        ignore_thresh: float = 0.7,
        box_gain: float = 1.0,
        obj_gain: float = 1.0,
        cls_gain: float = 1.0,
    ):
        super().__init__()
        if box not in BOX_LOSSES:
            raise ValueError(f"box must be one of {BOX_LOSSES}, got {box!r}")
        self.num_classes, self.box, self.ignore_thresh = num_classes, box, ignore_thresh
        self.matcher = AnchorMatcher(anchors, strides)
        self.anchors, self.strides = self.matcher.anchors, self.matcher.strides
        self.gains = {"box": box_gain, "obj": obj_gain, "cls": cls_gain}
        self._constants = ConstantCache()   # grid cells and anchor sizes per level, map size and device

    def extra_repr(self) -> str:
        gains = ", ".join(f"{k}_gain={v}" for k, v in self.gains.items())
        return f"num_classes={self.num_classes}, box={self.box!r}, ignore_thresh={self.ignore_thresh}, {gains}"

    channel_layout = "A * (5 + C)"
    takes_padded_targets = True

    def map_channels(self) -> list[int]:
        return [len(a) * (5 + self.num_classes) for a in self.anchors]

    def _loss(self, maps: list[Tensor], targets: Tensor, max_boxes: int | None) -> tuple[Tensor, dict[str, Tensor]]:
        b, c, device = maps[0].shape[0], self.num_classes, maps[0].device
        shapes = [tuple(m.shape[-2:]) for m in maps]
        image_area = float(shapes[0][0] * shapes[0][1] * self.strides[0] ** 2)
        valid = None
        if isinstance(targets, PaddedTargets):   # a static shape (CUDA graphs): B * G rows, padding not valid
            gt, (image, labels, boxes, valid) = targets, targets.rows()
            targets = torch.cat((image[:, None].to(boxes.dtype), labels[:, None].to(boxes.dtype), boxes), dim=1)
        else:
            gt = pad_targets(targets, b, max_boxes=max_boxes)  # reads G back unless max_boxes is given
        match = self.matcher(targets, shapes)
        labels, gt_xyxy = targets[:, 1].long(), targets[:, 2:6]
        rows = torch.arange(targets.shape[0], device=device)
        box = obj = cls = maps[0].new_zeros(())
        for level, (m, anchors, stride) in enumerate(zip(maps, self.anchors, self.strides, strict=True)):
            (h, w), a = shapes[level], len(anchors)
            # split, not slices: backward then builds the map's gradient with a single cat
            t, o, logits = m.reshape(b, a, 5 + c, h * w).split((4, 1, c), dim=2)  # [B, A, 4|1|C, HW]
            cells, anchor_wh = self._constants.get((h, w, level, device), lambda h=h, w=w, anchors=anchors: (
                grid_points([(h, w)], [1], offset=0.0, device=device)[0],           # [HW, 2] (column, row)
                upload(anchors, torch.float32, device)))                            # [A, 2]: one copy, then cached
            # every GT row, weighted 1 where it trains at this level and 0 elsewhere (no count is read back)
            here = match.level == level if valid is None else (match.level == level) & valid
            img = match.image
            anc = torch.where(here, match.anchor, 0)
            cell = torch.where(here, match.cell_y * w + match.cell_x, 0)

            # scatter_add_ on flat offsets, not index_put_(accumulate=True): on CUDA that one reads the
            # indices' range back and sorts them, and both wait for the device
            at = (img * a + anc) * (h * w) + cell
            obj_target = o.new_zeros(b * a * h * w).scatter_add_(0, at, here.float()).view(b, a, h * w)
            positive = obj_target > 0
            obj_target = positive.float()
            with torch.no_grad():
                boxes = anchor_to_box(t.transpose(2, 3), cells, stride, anchor_wh[:, None]).flatten(1, 2)  # [B, Q, 4]
                best = _max_iou(boxes, gt.boxes, gt.mask)
                keep = ~((best.view(b, a, h * w) > self.ignore_thresh) & ~positive)
            obj_bce = F.binary_cross_entropy_with_logits(o.squeeze(2), obj_target, reduction="none")
            obj = obj + (obj_bce * keep).sum()

            # one multi-hot class target per positive anchor, however many GTs landed on it: the
            # anchor's first row holds the classes of all its rows; the others weigh 0
            key = torch.where(here, (img * a + anc) * (h * w) + cell, b * a * h * w)
            first = torch.full((b * a * h * w + 1,), len(rows), dtype=torch.long, device=device)
            first = first.scatter_reduce_(0, key, rows, "amin")[key]
            cls_target = o.new_zeros(len(rows) * c).scatter_add_(0, first * c + labels, here.float()).view(len(rows), c)
            cls_target.clamp_(max=1.0)
            bce = F.binary_cross_entropy_with_logits(pick(logits, img, anc, None, cell), cls_target, reduction="none")
            cls = cls + (bce.sum(-1) * (here & (first == rows))).sum()

            t_gt = pick(t, img, anc, None, cell)  # [N, 4]: t[img, anc, :, cell], its backward without a sort
            if self.box == "ciou":
                pred = anchor_to_box(t_gt, cells[cell], stride, anchor_wh[anc])
                box = box + ((1.0 - ciou(pred, gt_xyxy)) * here).sum()
            else:
                err = _squared_error(t_gt, gt_xyxy, cells[cell], stride, anchor_wh[anc], image_area)
                box = box + (err * here).sum()

        parts = {"box": box / b * self.gains["box"], "obj": obj / b * self.gains["obj"],
                 "cls": cls / b * self.gains["cls"]}
        total = parts["box"] + parts["obj"] + parts["cls"]
        return total, {k: v.detach() for k, v in parts.items()}


def _squared_error(t: Tensor, gt: Tensor, cell: Tensor, stride: float, anchor_wh: Tensor, image_area: float) -> Tensor:
    """The paper's squared error on (tx, ty, tw, th), scaled by 2 - relative GT area: Tensor[N].

    Args:
        t: Tensor[N, 4] raw predictions.
        gt: Tensor[N, 4] xyxy GT boxes in pixels.
        cell: Tensor[N, 2] (column, row) of the cell each GT trains.
        stride: stride of the level.
        anchor_wh: Tensor[N, 2] anchor sizes in pixels.
        image_area: input height * width in pixels.
    """
    gt_wh = (gt[:, 2:] - gt[:, :2]).clamp(min=1e-3)
    target_xy = (gt[:, :2] + gt[:, 2:]) / 2 / stride - cell
    target_wh = (gt_wh / anchor_wh).log()
    scale = 2.0 - gt_wh.prod(-1) / image_area
    err = (t[:, :2].sigmoid() - target_xy).pow(2).sum(-1) + (t[:, 2:] - target_wh).pow(2).sum(-1)
    return scale * err


def _max_iou(boxes: Tensor, gt_boxes: Tensor, gt_mask: Tensor) -> Tensor:
    """Tensor[B, Q]: best IoU of each predicted box with the real GT boxes of its image.

    Args:
        boxes: Tensor[B, Q, 4] xyxy.
        gt_boxes: Tensor[B, G, 4] xyxy.
        gt_mask: Tensor[B, G] bool.
    """
    if gt_boxes.shape[1] == 0:
        return boxes.new_zeros(boxes.shape[:2])
    p = boxes[:, :, None, :].unbind(-1)  # each [B, Q, 1]
    g = gt_boxes[:, None, :, :].unbind(-1)  # each [B, 1, G]
    iw = torch.minimum(p[2], g[2]).sub_(torch.maximum(p[0], g[0])).clamp_(min=0)
    ih = torch.minimum(p[3], g[3]).sub_(torch.maximum(p[1], g[1])).clamp_(min=0)
    inter = iw.mul_(ih)
    area_p = (p[2] - p[0]).clamp(min=0) * (p[3] - p[1]).clamp(min=0)
    area_g = (g[2] - g[0]).clamp(min=0) * (g[3] - g[1]).clamp(min=0)
    iou = inter.div_((area_p + area_g).sub_(inter).add_(1e-9))  # [B, Q, G]
    return iou.masked_fill_(~gt_mask[:, None, :], 0.0).amax(dim=-1)
