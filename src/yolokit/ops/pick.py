"""Advanced indexing whose backward never makes the host wait: ``pick(x, i, None, j)`` is ``x[i, :, j]``.

The gradient of ``x[i, j]`` is built by ``index_put_(..., accumulate=True)``, which on CUDA sorts
the indices first, and that sort waits for the device. The gradient of `pick` is one
``scatter_add_`` into zeros, at the picked elements' offsets, which queues a kernel and returns.
The forward is the same indexing as ``x[...]`` (one gather kernel), and the result is the same.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def pick(x: Tensor, *indices: Tensor | None) -> Tensor:
    """``x[indices]`` with an index tensor for dim 0 and ``None`` for a whole dim, and a backward
    without a host wait (a ``scatter_add_``, not an accumulating ``index_put_``).

    Args:
        x: any strided tensor (a view, channels_last: nothing is copied).
        indices: one entry per leading dim of ``x``: a 1-D int64 tensor (all of the same length
            N), or None for the whole dim. The first must be a tensor; dims after the last entry
            are taken whole.

    Returns:
        Tensor[N, *sizes of the whole dims]: as ``x[i, :, j]`` gives it (the picked dim first).

    Examples:
        >>> x = torch.arange(24.0).view(2, 3, 4)
        >>> pick(x, torch.tensor([1, 0]), None, torch.tensor([3, 2])).tolist()
        [[15.0, 19.0, 23.0], [2.0, 6.0, 10.0]]
    """
    if not indices or indices[0] is None:
        raise ValueError("pick needs an index tensor for dim 0")
    if len(indices) > x.ndim:
        raise IndexError(f"{len(indices)} indices for a tensor of {x.ndim} dims")
    return _Pick.apply(x, *indices)


def pick_offsets(shape: torch.Size | tuple[int, ...], indices: tuple[Tensor | None, ...]) -> Tensor:
    """Offsets, in a contiguous tensor of ``shape``, of ``pick``'s elements: int64 Tensor[N, *whole dims]."""
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    given = [(d, i) for d, i in enumerate(indices) if i is not None]
    whole = [d for d in range(len(shape)) if d >= len(indices) or indices[d] is None]
    base = sum(i * strides[d] for d, i in given)                     # [N]
    offsets = base.view(-1, *[1] * len(whole))
    for k, d in enumerate(whole):
        view = [1] * (len(whole) + 1)
        view[k + 1] = shape[d]
        offsets = offsets + (torch.arange(shape[d], device=base.device) * strides[d]).view(view)
    return offsets


class _Pick(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, *indices: Tensor | None) -> Tensor:   # noqa: D102
        ctx.shape, ctx.given = x.shape, tuple(i is not None for i in indices)
        ctx.save_for_backward(*(i for i in indices if i is not None))
        return x[tuple(slice(None) if i is None else i for i in indices)]

    @staticmethod
    def backward(ctx, grad: Tensor):   # noqa: D102
        saved = iter(ctx.saved_tensors)
        indices = tuple(next(saved) if g else None for g in ctx.given)
        offsets = pick_offsets(ctx.shape, indices)
        out = grad.new_zeros(math.prod(ctx.shape)).scatter_add_(0, offsets.reshape(-1), grad.reshape(-1))
        return (out.view(ctx.shape), *[None] * len(indices))
