"""Box formats, areas and the IoU family.

Boxes are ``xyxy`` in absolute pixels unless a function says otherwise. Half-precision
inputs are upcast to float32 before any area or IoU arithmetic, so the results of the
IoU functions are float32 (or float64 for float64 inputs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

FORMATS = ("xyxy", "cxcywh", "xywh")


def _upcast(t: Tensor) -> Tensor:
    """Float32 for half/bfloat16 and integer boxes, the input dtype otherwise."""
    if t.is_floating_point():
        return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
    return t.float()


def box_convert(boxes: Tensor, in_fmt: str, out_fmt: str) -> Tensor:
    """Converts boxes between ``xyxy``, ``cxcywh`` and ``xywh`` (top-left corner, size).

    Args:
        boxes: Tensor[..., 4].
        in_fmt: format of ``boxes``.
        out_fmt: wanted format.

    Returns:
        Tensor[..., 4] in ``out_fmt``, same dtype as ``boxes``.

    Examples:
        >>> box_convert(torch.tensor([[10.0, 20.0, 4.0, 6.0]]), "cxcywh", "xyxy")
        tensor([[ 8., 17., 12., 23.]])
    """
    for fmt in (in_fmt, out_fmt):
        if fmt not in FORMATS:
            raise ValueError(f"unknown box format {fmt!r}; expected one of {FORMATS}")
    if in_fmt == out_fmt:
        return boxes.clone()
    a, b, c, d = boxes.unbind(-1)
    if in_fmt == "cxcywh":
        x1, y1, x2, y2 = a - c / 2, b - d / 2, a + c / 2, b + d / 2
    elif in_fmt == "xywh":
        x1, y1, x2, y2 = a, b, a + c, b + d
    else:
        x1, y1, x2, y2 = a, b, c, d
    if out_fmt == "xyxy":
        out = (x1, y1, x2, y2)
    elif out_fmt == "cxcywh":
        out = ((x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1)
    else:
        out = (x1, y1, x2 - x1, y2 - y1)
    return torch.stack(out, dim=-1)


def box_area(boxes: Tensor) -> Tensor:
    """Area of ``xyxy`` boxes; degenerate (inverted) boxes have area 0.

    Args:
        boxes: Tensor[..., 4] xyxy.

    Returns:
        Tensor[...] of areas (float32 for half inputs).
    """
    boxes = _upcast(boxes)
    return (boxes[..., 2] - boxes[..., 0]).clamp(min=0) * (boxes[..., 3] - boxes[..., 1]).clamp(min=0)


def box_iou(boxes1: Tensor, boxes2: Tensor, eps: float = 1e-7) -> Tensor:
    """Pairwise IoU of two sets of ``xyxy`` boxes.

    Args:
        boxes1: Tensor[N, 4].
        boxes2: Tensor[M, 4].
        eps: added to the union so that two empty boxes give 0, not NaN.

    Returns:
        Tensor[N, M].
    """
    boxes1, boxes2 = _upcast(boxes1), _upcast(boxes2)
    lt = torch.maximum(boxes1[:, None, :2], boxes2[None, :, :2])
    rb = torch.minimum(boxes1[:, None, 2:], boxes2[None, :, 2:])
    inter = _wh_area((rb - lt).clamp(min=0))
    union = box_area(boxes1)[:, None] + box_area(boxes2)[None, :] - inter
    return inter / (union + eps)


def _wh_area(wh: Tensor) -> Tensor:
    """``wh[..., 0] * wh[..., 1]``. Not ``wh.prod(-1)``: prod's backward looks for zeros in its input and
    reads the answer back (on CUDA the host waits); a product's backward is two multiplications."""
    return wh[..., 0] * wh[..., 1]


def _aligned(boxes1: Tensor, boxes2: Tensor, eps: float) -> tuple[Tensor, ...]:
    """Shared terms of the matched-pair IoU family: (iou, enclosing x1y1, x2y2, union)."""
    try:
        boxes1, boxes2 = torch.broadcast_tensors(_upcast(boxes1), _upcast(boxes2))
    except RuntimeError:
        raise ValueError(f"matched-pair IoU needs broadcastable shapes, got {tuple(boxes1.shape)} "
                         f"and {tuple(boxes2.shape)}") from None
    lt = torch.maximum(boxes1[..., :2], boxes2[..., :2])
    rb = torch.minimum(boxes1[..., 2:], boxes2[..., 2:])
    inter = _wh_area((rb - lt).clamp(min=0))
    union = box_area(boxes1) + box_area(boxes2) - inter + eps
    enc_lt = torch.minimum(boxes1[..., :2], boxes2[..., :2])
    enc_rb = torch.maximum(boxes1[..., 2:], boxes2[..., 2:])
    return boxes1, boxes2, inter / union, enc_lt, enc_rb, union


def iou(boxes1: Tensor, boxes2: Tensor, eps: float = 1e-7) -> Tensor:
    """IoU of matched pairs of ``xyxy`` boxes.

    Args:
        boxes1: Tensor[..., 4].
        boxes2: Tensor[..., 4], broadcastable with ``boxes1``.
        eps: added to the union.

    Returns:
        Tensor[...] (``[N]`` for ``[N, 4]`` inputs).
    """
    return _aligned(boxes1, boxes2, eps)[2]


def giou(boxes1: Tensor, boxes2: Tensor, eps: float = 1e-7) -> Tensor:
    """Generalized IoU of matched pairs: IoU - (enclosing area - union) / enclosing area.

    Returns:
        Tensor[...] in [-1, 1].
    """
    _, _, u, enc_lt, enc_rb, union = _aligned(boxes1, boxes2, eps)
    enclosing = _wh_area((enc_rb - enc_lt).clamp(min=0)) + eps
    return u - (enclosing - union) / enclosing


def _centre_term(b1: Tensor, b2: Tensor, enc_lt: Tensor, enc_rb: Tensor, eps: float) -> Tensor:
    """Squared centre distance over squared enclosing diagonal (the DIoU penalty)."""
    diag2 = ((enc_rb - enc_lt) ** 2).sum(-1) + eps
    centre2 = (((b1[..., :2] + b1[..., 2:]) - (b2[..., :2] + b2[..., 2:])) ** 2).sum(-1) / 4
    return centre2 / diag2


def diou(boxes1: Tensor, boxes2: Tensor, eps: float = 1e-7) -> Tensor:
    """Distance IoU of matched pairs: IoU - centre distance^2 / enclosing diagonal^2.

    Returns:
        Tensor[...] in [-1, 1].
    """
    b1, b2, u, enc_lt, enc_rb, _ = _aligned(boxes1, boxes2, eps)
    return u - _centre_term(b1, b2, enc_lt, enc_rb, eps)


def ciou(boxes1: Tensor, boxes2: Tensor, eps: float = 1e-7) -> Tensor:
    """Complete IoU of matched pairs: DIoU - alpha * v.

    ``v = 4 / pi^2 * (atan(w2 / h2) - atan(w1 / h1))^2`` measures the aspect-ratio
    mismatch and ``alpha = v / (v - IoU + 1 + eps)`` is treated as a constant (no
    gradient), as in the CIoU paper (Zheng et al., 2020).

    Args:
        boxes1: Tensor[..., 4] xyxy (predictions).
        boxes2: Tensor[..., 4] xyxy (targets).
        eps: guards divisions.

    Returns:
        Tensor[...] in [-1.5, 1].
    """
    b1, b2, u, enc_lt, enc_rb, _ = _aligned(boxes1, boxes2, eps)
    w1, h1 = b1[..., 2] - b1[..., 0], (b1[..., 3] - b1[..., 1]).clamp(min=0) + eps
    w2, h2 = b2[..., 2] - b2[..., 0], (b2[..., 3] - b2[..., 1]).clamp(min=0) + eps
    v = (4 / math.pi**2) * (torch.atan(w2 / h2) - torch.atan(w1 / h1)) ** 2
    with torch.no_grad():
        alpha = v / (v - u + (1 + eps))
    return u - _centre_term(b1, b2, enc_lt, enc_rb, eps) - alpha * v


def clip_boxes(boxes: Tensor, shape: Sequence[int]) -> Tensor:
    """Clips ``xyxy`` boxes to an image of ``shape`` = (height, width); returns a new tensor."""
    h, w = int(shape[0]), int(shape[1])
    out = boxes.clone()
    out[..., 0::2] = out[..., 0::2].clamp(0, w)
    out[..., 1::2] = out[..., 1::2].clamp(0, h)
    return out
