"""YOLO26-seg's assignment by mask quality: a (GT, point) pair's overlap is the mean of its box CIoU and its
predicted mask's IoU with the GT's mask (used by ``TaskAlignedAssigner.assign_rows(masks=...)``)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from yolokit.ops.masks import box_window


class MaskInputs(NamedTuple):
    """What the assigner needs to score predicted masks (YOLO26-seg): the overlap of a (GT, point) pair is
    then the mean of its box CIoU and its predicted mask's IoU with the GT's mask.

    Attributes:
        coefficients: Tensor[B, P, M] each point's mask coefficients.
        protos: Tensor[B, M, h, w] each image's prototypes.
        scale: prototype pixels per input pixel (h / the input's height).
        gt_masks: Tensor[N, h, w] bool, the mask of each GT row (rows as ``assign_rows`` takes them).
    """

    coefficients: Tensor
    protos: Tensor
    scale: float
    gt_masks: Tensor


def with_mask_iou(u: Tensor, s: Tensor, outside: Tensor, masks: MaskInputs, pred_boxes: Tensor, image: Tensor,
                  rows: slice, topk: int, alpha: float, beta: float, eps: float) -> Tensor:
    """A chunk's u (Tensor[b_c, g_c, P], clamped CIoU) as ``(u + mask IoU) / 2``: the mask IoU for each GT's
    ``3 * topk`` points of highest box-only t (``s^alpha * u^beta + eps`` inside, 0 outside), 0 elsewhere.
    ``s``: Tensor[r, P] the GT class's scores; ``image``: Tensor[r] each row's image; ``topk``, ``alpha``,
    ``beta``, ``eps``: the assigner's."""
    r, p = image.shape[0], s.shape[-1]
    inside = ~outside.view(r, p)
    box_t = torch.where(inside, s.pow(alpha) * u.view(r, p).pow(beta) + eps, 0.0)
    top = box_t.topk(min(3 * topk, p), dim=-1).indices                    # [r, k3]
    chosen = inside.gather(1, top)
    (h, w), m = masks.protos.shape[-2:], masks.protos.shape[1]
    coef = masks.coefficients[image[:, None], top].float()                          # [r, k3, M]
    predicted = torch.bmm(coef, masks.protos[image].float().view(r, m, h * w)) > 0  # [r, k3, h * w]
    box = pred_boxes[image[:, None], top].view(-1, 4) * masks.scale
    cols, rows_in = box_window(box, h, w)
    predicted = (predicted.view(-1, h, w) & cols.bool() & rows_in.bool()).view(r, -1, h * w)
    gt = masks.gt_masks[rows].view(r, 1, h * w)
    inter = (predicted & gt).sum(-1).float()
    union = gt.sum(-1).float() + predicted.sum(-1).float() - inter
    iou = torch.where(chosen, inter / union.clamp(min=1), 0.0)
    dense = torch.zeros(r, p, device=u.device).scatter_(1, top, iou)
    return ((u.view(r, p) + dense) / 2).view_as(u)
