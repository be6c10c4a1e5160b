"""CIoU of every (GT, point) pair for the task-aligned assigner, from per-box terms.

``ops.boxes.ciou`` works on matched pairs [N]; the assigner needs a GT against every
point, chunk by chunk. Broadcasting the boxes would repeat each box's width, height,
area and aspect angle for every pair, so those are computed once per box here
(:func:`box_terms`) and combined over broadcast shapes (:func:`pairwise_ciou`), with the
operations of ``ops.boxes.ciou`` in the same order: the results are equal bit for bit.
:func:`ciou_unclamped` is the matched-pair CIoU of YOLO26's box term, inverted boxes as they are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

CIOU_EPS = 1e-7  # ops.boxes.ciou's default eps, which the pairwise CIoU here repeats


def box_terms(boxes: Tensor) -> tuple[Tensor, ...]:
    """Per-box terms of ``ops.boxes.ciou``, computed as it does.

    Args:
        boxes: Tensor[..., 4] xyxy.

    Returns:
        ``(x1, y1, x2, y2, area, atan(w / h))``, each Tensor[...].
    """
    x1, y1, x2, y2 = boxes.unbind(-1)
    area = (x2 - x1).clamp(min=0) * (y2 - y1).clamp(min=0)
    return x1, y1, x2, y2, area, torch.atan((x2 - x1) / ((y2 - y1).clamp(min=0) + CIOU_EPS))


def pairwise_ciou(pred: Sequence[Tensor], gt: Sequence[Tensor]) -> Tensor:
    """``ops.boxes.ciou(pred, gt)`` over the broadcast pairs of two sides' :func:`box_terms`.

    Same operations in the same order as ``ops.boxes.ciou`` (equal results, bit for bit),
    in place where it can: a fraction of the memory traffic of broadcasting the boxes.

    Args:
        pred: The six terms of the predicted boxes, each broadcastable with ``gt``'s.
        gt: The six terms of the GT boxes.

    Returns:
        Tensor of the broadcast shape, the CIoU of each pair.
    """
    px1, py1, px2, py2, p_area, p_atan = pred
    gx1, gy1, gx2, gy2, g_area, g_atan = gt
    eps = CIOU_EPS
    inter = torch.minimum(px2, gx2).sub_(torch.maximum(px1, gx1)).clamp_(min=0)
    inter.mul_(torch.minimum(py2, gy2).sub_(torch.maximum(py1, gy1)).clamp_(min=0))
    u = inter.div_((p_area + g_area).sub_(inter).add_(eps))
    ex = torch.maximum(px2, gx2).sub_(torch.minimum(px1, gx1))
    ey = torch.maximum(py2, gy2).sub_(torch.minimum(py1, gy1))
    diag2 = ex.mul_(ex).add_(ey.mul_(ey)).add_(eps)
    cx, cy = (px1 + px2) - (gx1 + gx2), (py1 + py2) - (gy1 + gy2)
    centre = cx.mul_(cx).add_(cy.mul_(cy)).div_(4).div_(diag2)
    v = (g_atan - p_atan).pow_(2).mul_(4 / math.pi**2)
    alpha = v / (v - u + (1 + eps))
    return (u - centre).sub_(alpha.mul_(v))


def ciou_unclamped(pred: Tensor, target: Tensor, eps: float = 1e-7) -> Tensor:
    """CIoU of matched ``xyxy`` pairs with sides taken as they are, as Ultralytics' box term has it.

    Unlike ``yolokit.ops.boxes.ciou`` nothing is clamped: an inverted box (x2 < x1 or y2 < y1, which
    a head of raw distances can predict) keeps its negative side in the area and the aspect term
    (``atan(w / (h + eps))`` with h < 0). Its intersection is 0 either way. For boxes of positive
    size the two agree to rounding. ``alpha`` is a constant (no gradient), as in the CIoU paper.

    Args:
        pred: Tensor[..., 4].
        target: Tensor[..., 4].
        eps: added to the heights, the union and the squared enclosing diagonal.

    Returns:
        Tensor[...].
    """
    px1, py1, px2, py2 = pred.unbind(-1)
    tx1, ty1, tx2, ty2 = target.unbind(-1)
    pw, ph = px2 - px1, py2 - py1 + eps
    tw, th = tx2 - tx1, ty2 - ty1 + eps
    overlap = (torch.minimum(px2, tx2) - torch.maximum(px1, tx1)).clamp(min=0) * \
        (torch.minimum(py2, ty2) - torch.maximum(py1, ty1)).clamp(min=0)
    iou = overlap / (pw * ph + tw * th - overlap + eps)
    enclosing2 = (torch.maximum(px2, tx2) - torch.minimum(px1, tx1)) ** 2 + \
        (torch.maximum(py2, ty2) - torch.minimum(py1, ty1)) ** 2 + eps
    centre2 = ((tx1 + tx2 - px1 - px2) ** 2 + (ty1 + ty2 - py1 - py2) ** 2) / 4
    v = (4 / math.pi**2) * (torch.atan(tw / th) - torch.atan(pw / ph)) ** 2
    with torch.no_grad():
        alpha = v / (v - iou + (1 + eps))
    return iou - (centre2 / enclosing2 + v * alpha)
