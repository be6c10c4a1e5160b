"""Counting the operations of a block of code that make the host wait for the device.

On a GPU, reading a value back (``t.item()``, ``float(t)``, ``bool(t)``, ``t.tolist()``)
or running an operation whose output shape depends on the data (``nonzero``, boolean-mask
indexing, ``unique``, ...) stops the host until the device has caught up. On the CPU the
same calls cost nothing extra, so a CPU test cannot time them; it can count them, which
is what ``count_host_syncs`` does:

    >>> with count_host_syncs() as syncs:
    ...     total, parts = loss(maps, targets)
    >>> assert not syncs, dict(syncs)

The counts are by name: an aten op's name (``_local_scalar_dense`` for item/int/float/bool,
``nonzero``, ``masked_select``, ``bincount``, ...), ``index (bool mask)`` and ``index_put
(bool mask)`` for boolean-mask indexing and assignment, ``tolist`` and ``numpy`` for the
two conversions that read CPU memory without an aten op, and ``copy to cpu`` for a copy
from another device to the CPU. Plain arithmetic, indexing with integer tensors,
``gather``/``scatter`` and reductions that stay on the device are not counted.

The other direction, CUDA waiting for the host, is counted too, as far as a CPU run shows it:

- ``index_put (accumulate)``: an accumulating ``index_put_`` (the backward of ``x[i, j]``, or
  called directly) reads its indices' range back and sorts them on CUDA;
- ``host value written by indexing``: ``x[i] = True`` with index tensors turns the Python value
  into a host tensor that ``index_put_`` copies to the device, blocking (so does a
  ``torch.tensor([...])`` written there);
- ``host data into the step``: ``torch.tensor(...)``, ``torch.as_tensor(list)`` or
  ``torch.from_numpy`` inside the block (``aten.lift_fresh``); on CUDA each is a copy from
  pageable host memory that waits. A Python value written into a slice (``x[:, 0] = 1``, a
  ``fill_``) is not counted: that reads the value on the host and launches a fill;
- ``pageable copy to the device``: a copy from unpinned host memory to another device (seen
  where the block runs on a GPU).

Host data made into tensors while a ``yolokit.ops.cache.ConstantCache`` builds an entry is not
counted: that happens once per key, and ``ops.cache.upload`` copies it from pinned memory,
asynchronously, on CUDA.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from yolokit.ops.cache import ConstantCache

# aten ops that read a value back to the host or whose output shape depends on the data
_SYNC_OPS = frozenset({
    "_local_scalar_dense",  # .item(), int(t), float(t), bool(t), t == 0 in an if
    "nonzero", "nonzero_numpy", "argwhere", "masked_select", "bincount",
    "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive",
    "equal", "is_nonzero", "_assert_async", "allclose",
})


def _has_bool_index(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


_INDEX_PUT = ("_index_put_impl_", "_index_put_impl", "index_put", "index_put_")


def _accumulates(args, kwargs) -> bool:
    return bool(kwargs.get("accumulate", args[3] if len(args) > 3 else False))


class _SyncCounter(TorchDispatchMode):
    def __init__(self, counts: Counter[str]):
        super().__init__()
        self.counts = counts
        self.lifted: dict[int, weakref.ref] = {}    # host data made into tensors in the block, not used yet
        self.building = 0                           # inside ConstantCache.get's make: constants, once per key

    def _lifted(self, t: Any) -> bool:
        ref = self.lifted.pop(id(t), None) if isinstance(t, torch.Tensor) else None
        return ref is not None and ref() is t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        lifted = [a for a in args if self._lifted(a)]
        # repeat_interleave without output_size syncs: its size is repeats.sum()
        if name in _SYNC_OPS or (name == "repeat_interleave" and kwargs.get("output_size") is None):
            self.counts[name] += 1
        elif name in ("index", *_INDEX_PUT) and _has_bool_index(args[1]):
            self.counts["index_put (bool mask)" if "put" in name else "index (bool mask)"] += 1
        elif name in _INDEX_PUT and _accumulates(args, kwargs):
            self.counts["index_put (accumulate)"] += 1
        elif name in ("_to_copy", "copy_") and _crosses_to_cpu(func, args, kwargs):
            self.counts["copy to cpu"] += 1
        elif name in ("_to_copy", "copy_") and _pageable_to_device(func, args, kwargs):
            self.counts["pageable copy to the device"] += 1
        if lifted:
            if name in _INDEX_PUT and any(a is args[2] for a in lifted):
                self.counts["host value written by indexing"] += 1
            elif name != "fill_":
                self.counts["host data into the step"] += 1
        out = func(*args, **kwargs)
        if name in ("lift_fresh", "lift_fresh_copy") and isinstance(out, torch.Tensor) and not self.building:
            self.lifted[id(out)] = weakref.ref(out)
        return out


def _pageable_to_device(func, args, kwargs) -> bool:
    src = args[1] if func.overloadpacket.__name__ == "copy_" else args[0]
    dst_device = args[0].device if func.overloadpacket.__name__ == "copy_" else kwargs.get("device")
    return (isinstance(src, torch.Tensor) and src.device.type == "cpu" and dst_device is not None
            and torch.device(dst_device).type not in ("cpu", "meta") and not src.is_pinned())


def _crosses_to_cpu(func, args, kwargs) -> bool:
    src = args[1] if func.overloadpacket.__name__ == "copy_" else args[0]
    dst_device = args[0].device if func.overloadpacket.__name__ == "copy_" else kwargs.get("device")
    return (isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst_device is not None
            and torch.device(dst_device).type == "cpu")


@contextmanager
def count_host_syncs() -> Iterator[Counter[str]]:
    """Counts, by name, the host reads and data-dependent-shape ops run inside the block.

    Yields:
        A ``Counter`` filled while the block runs (empty when there was none).
    """
    counts: Counter[str] = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}
    own = {name for name in originals if name in vars(torch.Tensor)}

    def reading(name: str):
        def read(self, *args, **kwargs):
            counts[name] += 1
            return originals[name](self, *args, **kwargs)
        return read

    mode = _SyncCounter(counts)
    original_get = ConstantCache.get

    def get(cache, key, make):
        def build():
            mode.building += 1
            try:
                return make()
            finally:
                mode.building -= 1
        return original_get(cache, key, build)

    for name in originals:
        setattr(torch.Tensor, name, reading(name))
    ConstantCache.get = get
    try:
        with mode:
            yield counts
    finally:
        ConstantCache.get = original_get
        for name, fn in originals.items():
            if name in own:
                setattr(torch.Tensor, name, fn)
            else:
                delattr(torch.Tensor, name)  # inherited from torch._C.TensorBase
