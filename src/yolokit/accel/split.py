"""Cutting a batch into micro-batches along the image dimension (what :class:`Accumulator` replays after OOM)."""

from __future__ import annotations

from typing import Any

import torch

INDEX_KEYS = ("targets",)  # batch-dict keys holding flat rows (image_index, ...), see ARCHITECTURE
# batch-dict keys every micro-batch keeps whole: the sources the device augmentation's per-image
# recipes (``aug_tiles`` ...) point into by number (``yolokit.data.augment.recipes``)
SHARED_KEYS = ("aug_sources", "aug_jpeg", "aug_pixels", "aug_files")


def batch_len(batch: Any) -> int:
    """Images in a batch: the first dimension of its images (or of its first tensor)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, dict):
        for key in ("images", "images_uint8", "aug_tiles"):   # aug_tiles: a numpy array, one row an image
            if hasattr(batch.get(key), "shape"):
                return batch[key].shape[0]
    for v in batch.values() if isinstance(batch, dict) else batch:
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return v.shape[0]
    raise ValueError("cannot find the batch size: no tensor in the batch")


def _is_array(value: Any) -> bool:
    """A numpy array (accel imports torch only: known by its type's module, not imported)."""
    return type(value).__module__ == "numpy" and hasattr(value, "ndim")


def _slice(value: Any, n: int, lo: int, hi: int, key: Any = None) -> Any:
    if key in SHARED_KEYS:
        return value
    if key in INDEX_KEYS and isinstance(value, torch.Tensor) and value.dim() == 2:
        rows = value[(value[:, 0] >= lo) & (value[:, 0] < hi)].clone()
        rows[:, 0] -= lo
        return rows
    if isinstance(value, torch.Tensor) or _is_array(value):
        return value[lo:hi] if value.ndim > 0 and value.shape[0] == n else value
    if isinstance(value, dict):
        return {k: _slice(v, n, lo, hi, k) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and len(value) == n:
        return value[lo:hi]
    return value


def split_batch(batch: Any, parts: int) -> list[Any]:
    """Split a batch into ``parts`` micro-batches along the image dimension.

    Tensors and numpy arrays whose first dimension is the batch size ``B`` are sliced; in a
    dict, the ``targets`` Tensor[N, 6] rows ``(image_index, class, x1, y1, x2, y2)`` are
    selected by image index and re-indexed from 0; per-image lists (``paths``, ``orig_shapes``)
    are sliced; the device augmentation's sources (``SHARED_KEYS``) stay whole in every part;
    anything else is passed through. A top-level list/tuple is a tuple of fields.
    With ``parts == 1`` the batch itself is returned (no copy).

    Args:
        batch: Tensor[B, ...], a dict (the yolokit batch), or a tuple of fields.
        parts: Number of micro-batches (capped at ``B``); sizes differ by at most one.

    Returns:
        The micro-batches, in order.
    """
    n = batch_len(batch)
    parts = max(1, min(parts, n))
    if parts == 1:
        return [batch]
    sizes = [n // parts + (i < n % parts) for i in range(parts)]
    out, lo = [], 0
    for size in sizes:
        hi = lo + size
        if isinstance(batch, (list, tuple)) and not isinstance(batch, torch.Tensor):
            out.append(type(batch)(_slice(v, n, lo, hi) for v in batch))
        else:
            out.append(_slice(batch, n, lo, hi))
        lo = hi
    return out
