"""CIoU of every (GT, point) pair for the task-aligned assigner, from per-box terms.

``ops.boxes.ciou`` works on matched pairs [N]; the assigner needs a GT against every
point, chunk by chunk. Broadcasting the boxes would repeat each box's width, height,
area and aspect angle for every pair, so those are computed once per box here
(:func:`box_terms`) and combined over broadcast shapes (:func:`pairwise_ciou`), with the
operations of ``ops.boxes.ciou`` in the same order: the results are equal bit for bit.
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
