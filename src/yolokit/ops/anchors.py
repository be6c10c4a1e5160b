"""The detection maths heads and losses share: grid points and strides, distance <-> box,
the DFL expectation, and Darknet's anchor decode.

Anchor-free (DFL) heads predict, at each grid point, the distances from the point to the
four sides of a box: ``(left, top, right, bottom)``, written ``ltrb``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

MAX_LOG_SCALE = 10.0  # t_w, t_h are clamped here before exp: a box at most e^10 anchors wide


def grid_points(
    shapes: Sequence[tuple[int, int]],
    strides: Sequence[int],
    *,
    offset: float = 0.5,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """Centres of every grid cell of every level, in input pixels, level after level.

    Within a level the points run row by row (y outer, x inner), matching a feature map
    flattened with ``map.flatten(2)``.

    Args:
        shapes: (height, width) of each level's feature map.
        strides: stride of each level in input pixels.
        offset: position of the point inside its cell, 0.5 for the centre.
        dtype: dtype of the outputs.
        device: device of the outputs.

    Returns:
        ``(points, point_strides)``: Tensor[P, 2] of (x, y) in input pixels and
        Tensor[P] of each point's stride, P = sum of h * w over the levels.

    Examples:
        >>> points, s = grid_points([(2, 2)], [8])
        >>> points.tolist(), s.tolist()
        ([[4.0, 4.0], [12.0, 4.0], [4.0, 12.0], [12.0, 12.0]], [8.0, 8.0, 8.0, 8.0])
    """
    if len(shapes) != len(strides):
        raise ValueError(f"got {len(shapes)} level shapes but {len(strides)} strides")
    points, point_strides = [], []
    for (h, w), s in zip(shapes, strides, strict=True):
        ys = (torch.arange(h, dtype=dtype, device=device) + offset) * s
        xs = (torch.arange(w, dtype=dtype, device=device) + offset) * s
        gy, gx = torch.meshgrid(ys, xs, indexing="ij")
        points.append(torch.stack((gx, gy), dim=-1).reshape(-1, 2))
        point_strides.append(torch.full((h * w,), float(s), dtype=dtype, device=device))
    return torch.cat(points), torch.cat(point_strides)


def dist_to_box(distances: Tensor, points: Tensor) -> Tensor:
    """Boxes from ``ltrb`` distances to points.

    Args:
        distances: Tensor[..., P, 4] (left, top, right, bottom), same units as ``points``.
        points: Tensor[P, 2] (x, y).

    Returns:
        Tensor[..., P, 4] xyxy.
    """
    lt, rb = distances.chunk(2, dim=-1)
    return torch.cat((points - lt, points + rb), dim=-1)


def box_to_dist(boxes: Tensor, points: Tensor, max_dist: float | None = None) -> Tensor:
    """``ltrb`` distances from points to the sides of ``xyxy`` boxes.

    Args:
        boxes: Tensor[..., P, 4] xyxy.
        points: Tensor[P, 2] (x, y), same units as ``boxes``.
        max_dist: if given, distances are clamped to [0, max_dist].

    Returns:
        Tensor[..., P, 4] (left, top, right, bottom).
    """
    dist = torch.cat((points - boxes[..., :2], boxes[..., 2:] - points), dim=-1)
    if max_dist is not None:
        dist = dist.clamp(0, max_dist)
    return dist


def dfl_expectation(logits: Tensor, *, dim: int = -1, bins: Tensor | None = None) -> Tensor:
    """Expected distance of the distribution softmax(``logits``) over bins 0 .. R - 1.

    The DFL (distribution focal loss) head predicts, per box side, R logits over distances
    in stride units; the distance it means is the expectation. The bins may lie along the
    last dimension or the one before it, so a head's [B, 4, R, P] layout needs no permuted
    copy; both are one matmul.

    Args:
        logits: R bin logits along ``dim``, e.g. Tensor[N, 4, R] (``dim=-1``) or
            Tensor[B, 4, R, P] (``dim=-2``).
        dim: -1 or -2 (or the same position counted from the front).
        bins: Tensor[R] values of the bins, default 0 .. R - 1; cast to the softmax's dtype.

    Returns:
        ``logits`` without ``dim``: Tensor[N, 4] or Tensor[B, 4, P] in bin units.

    Examples:
        >>> dfl_expectation(torch.tensor([[0.0, 0.0, -1e4, -1e4]]))
        tensor([0.5000])
    """
    pos = dim % logits.ndim
    if pos not in (logits.ndim - 1, logits.ndim - 2):
        raise ValueError(f"the bins must lie along one of the last two dimensions, got dim={dim} "
                         f"of a {logits.ndim}-d tensor")
    probs = logits.softmax(dim)
    r = probs.shape[pos]
    bins = torch.arange(r, dtype=probs.dtype, device=probs.device) if bins is None else bins.to(probs.dtype)
    if pos == logits.ndim - 1:
        return probs @ bins
    return torch.matmul(bins, probs)


def anchor_to_box(t: Tensor, cells: Tensor, stride: float, anchor_wh: Tensor) -> Tensor:
    """Boxes from Darknet's anchor-relative predictions (all arguments broadcast).

    centre = (sigmoid(t_xy) + cell) * stride, size = exp(min(t_wh, ``MAX_LOG_SCALE``)) * anchor:
    Darknet's decoding, with the one clamp that keeps an untrained head's sizes finite.

    Args:
        t: Tensor[..., 4] raw (tx, ty, tw, th); more channels are ignored.
        cells: Tensor[..., 2] (column, row) of each prediction's cell.
        stride: stride of the level in pixels.
        anchor_wh: Tensor[..., 2] (w, h) of each prediction's anchor in pixels.

    Returns:
        Tensor[..., 4] xyxy in pixels.

    Examples:
        >>> anchor_to_box(torch.zeros(1, 4), torch.tensor([[2.0, 1.0]]), 8, torch.tensor([[10.0, 6.0]]))
        tensor([[15.,  9., 25., 15.]])
    """
    xy = (t[..., :2].sigmoid() + cells) * stride
    wh = t[..., 2:4].clamp(max=MAX_LOG_SCALE).exp() * anchor_wh
    return torch.cat((xy - wh / 2, xy + wh / 2), dim=-1)
