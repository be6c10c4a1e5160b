"""Counting what, in a block of code, makes the host wait for the device or the device for the host.

On a GPU, reading a value back (``t.item()``, ``float(t)``, ``bool(t)``, ``t.tolist()``) or
running an operation whose output shape depends on the data (``nonzero``, boolean-mask
indexing, ``unique``, ...) stops the host until the device has caught up; copying host data
into the step from pageable memory (``torch.tensor(...)``, ``x[i] = True``) makes the device
wait for the host. On the CPU the same calls cost nothing extra, so a CPU test cannot time
them; it can count them, which is what ``count_host_syncs`` does:

    >>> with count_host_syncs() as syncs:
    ...     total, parts = loss(maps, targets)
    >>> assert not syncs, syncs.details

The aten ops are read from ``torch.profiler`` (CPU activity, with the calls' arguments), not
from a ``TorchDispatchMode``: an active dispatch mode makes autograd take the formulas meant for
tensor subclasses, which skip the reads some backward formulas make for plain tensors (``prod``'s
backward looks for zeros with ``nonzero``), so a mode would hide exactly those. The counts are by
name:

- an aten op's name for the ops that read back or have data-dependent shapes
  (``_local_scalar_dense`` for item/int/float/bool, ``nonzero``, ``masked_select``,
  ``bincount``, ``_unique2``, ...), named after the outermost op that asked for them:
  ``index (bool mask)`` and ``index_put (bool mask)`` for boolean-mask indexing and assignment,
  ``repeat_interleave`` for repeats given as a tensor without ``output_size``;
- ``index_put (accumulate)``: an accumulating ``index_put_`` (the backward of ``x[i, j]``, or
  called directly), which on CUDA reads its indices' range back and sorts them;
- ``host value written by indexing``: ``x[i] = True`` with index tensors turns the Python value
  into a host tensor that ``index_put_`` copies to the device, blocking; a Python value written
  into a slice (``x[:, 0] = 1``, a fill that reads the value on the host) is not counted;
- ``host data into the step``: ``torch.tensor(...)``, ``torch.as_tensor(list)`` or
  ``torch.from_numpy`` inside the block: on CUDA each is a copy from pageable host memory that
  waits. Constants a ``yolokit.ops.cache.ConstantCache`` builds are not counted: that happens
  once per key, and ``ops.cache.upload`` copies them from pinned memory, asynchronously;
- ``tolist`` and ``numpy``, the two conversions that read memory without an aten op.

A fused optimizer's CPU kernel (``aten::_fused_adamw_``, ...) reads its step count with ``item``;
its CUDA kernel reads it on the device, so those reads are not counted. ``syncs.details`` says,
for each count, the autograd function it ran in (for a backward) and the op.
Copies between devices cannot be seen on the CPU; the ``gpu`` tests run the same steps under
``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.profiler import record_function

from yolokit.ops.cache import ConstantCache

# aten ops that read a value back to the host or whose output shape depends on the data
_SYNC_OPS = frozenset({
    "_local_scalar_dense",  # .item(), int(t), float(t), bool(t), t == 0 in an if
    "nonzero", "nonzero_numpy", "argwhere", "masked_select", "bincount",
    "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive",
    "equal", "is_nonzero", "_assert_async", "allclose",
})
_INDEX_PUT = frozenset({"index_put_", "index_put", "_index_put_impl_"})
_CONSTANT, _SET_INDEXED, _SET_SLICE = "yolokit::constant", "yolokit::setitem_indexed", "yolokit::setitem_slice"


class SyncCounts(Counter):
    """A Counter of sync names, and ``details``: one line per count."""

    details: list[str]


class _Event:
    """One profiled CPU op or annotation, with its enclosing one (``cpu_parent``) on the same thread."""

    __slots__ = ("name", "inputs", "cpu_parent")

    def __init__(self, raw, parent: _Event | None) -> None:
        self.name, self.cpu_parent = raw.name(), parent
        self.inputs = raw.concrete_inputs()


def _nested(raw_events) -> list[_Event]:
    """The raw profiler events as a forest, from their times on each thread (an enclosing op starts no
    later and ends no earlier). ``torch.profiler.profile``'s own parsing does this too, but costs about a
    second per training step here; this takes milliseconds."""
    threads: dict[int, list] = {}
    for raw in raw_events:
        threads.setdefault(raw.start_thread_id(), []).append(raw)
    events = []
    for raws in threads.values():
        raws.sort(key=lambda r: (r.start_ns(), -r.end_ns()))
        stack: list[tuple[int, _Event]] = []
        for raw in raws:
            while stack and stack[-1][0] <= raw.start_ns():           # those that ended before it began
                stack.pop()
            event = _Event(raw, stack[-1][1] if stack else None)
            events.append(event)
            stack.append((raw.end_ns(), event))
    return events


def _ancestors(event) -> list:
    chain, parent = [], event.cpu_parent
    while parent is not None:
        chain.append(parent)
        parent = parent.cpu_parent
    return chain


def _concrete(event, k: int):
    inputs = event.inputs or []
    return inputs[k] if k < len(inputs) else None


# the outermost op the code called, as a count's name, where it is not the op's own name
_OUTER_NAMES = {"index": "index (bool mask)", **{n: "index_put (bool mask)" for n in _INDEX_PUT},
                "where": "nonzero", "item": "_local_scalar_dense", "is_nonzero": "_local_scalar_dense"}


def _count(events, counts: SyncCounts) -> None:
    reported: set[int] = set()
    for event in events:
        name = event.name.removeprefix("aten::")
        accumulates = name == "_index_put_impl_" and _concrete(event, 3) is True
        if name != "lift_fresh" and name not in _SYNC_OPS and not accumulates:
            continue                                     # most events: nothing to look up
        chain = _ancestors(event)
        names = [e.name for e in chain]
        if name == "lift_fresh":
            if _CONSTANT in names or _SET_SLICE in names:
                continue
            key = "host value written by indexing" if _SET_INDEXED in names else "host data into the step"
        elif accumulates:
            key = "index_put (accumulate)"
        else:
            if any(n.startswith("aten::_fused_") for n in names):
                continue      # a fused optimizer's CPU kernel reads its step count on the host; CUDA's reads it there
            outer = next((e for e in reversed(chain) if e.name.startswith("aten::")), event)   # what the code called
            outer_name = outer.name.removeprefix("aten::")
            if outer_name == "repeat_interleave" and _concrete(outer, 3) is not None:
                continue                                 # output_size given: CUDA checks the repeats on the device
            if id(outer) in reported:
                continue                                 # one count per op the code called
            reported.add(id(outer))
            key = _OUTER_NAMES.get(outer_name, outer_name if outer_name in _SYNC_OPS | {"repeat_interleave"} else name)
        backward = next((n.split(": ", 1)[-1] for n in names if n.startswith("autograd::engine")), None)
        counts[key] += 1
        counts.details.append(f"{key}{f' in {backward}' if backward else ''}: {' < '.join([event.name, *names[:4]])}")


@contextmanager
def count_host_syncs() -> Iterator[SyncCounts]:
    """Counts, by name, the host reads, data-dependent shapes and host data run inside the block.

    Yields:
        A ``SyncCounts`` (a Counter), filled when the block ends (empty when there was none).
    """
    counts = SyncCounts()
    counts.details = []
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "__setitem__")}
    own = {name for name in originals if name in vars(torch.Tensor)}

    def reading(name: str):
        def read(self, *args, **kwargs):
            counts[name] += 1
            counts.details.append(f"{name}: Tensor.{name}()")
            return originals[name](self, *args, **kwargs)
        return read

    def setitem(self, index, value):
        if isinstance(value, torch.Tensor):
            return originals["__setitem__"](self, index, value)
        parts = index if isinstance(index, tuple) else (index,)
        indexed = any(isinstance(i, torch.Tensor) for i in parts)
        with record_function(_SET_INDEXED if indexed else _SET_SLICE):
            return originals["__setitem__"](self, index, value)

    original_get = ConstantCache.get

    def get(cache, key, make):
        def build():
            with record_function(_CONSTANT):
                return make()
        return original_get(cache, key, build)

    patches = {"tolist": reading("tolist"), "numpy": reading("numpy"), "__setitem__": setitem}
    for name, fn in patches.items():
        setattr(torch.Tensor, name, fn)
    ConstantCache.get = get
    prof = torch.autograd.profiler.profile(record_shapes=True)    # started and stopped by hand: its __exit__
    prof._prepare_trace()                                          # parses every event into Python objects,
    prof._start_trace()                                            # seconds per training step
    raw = None
    try:
        yield counts
        raw = torch.autograd.profiler._disable_profiler().events()
    finally:
        if raw is None:
            torch.autograd.profiler._disable_profiler()
        ConstantCache.get = original_get
        for name, fn in originals.items():
            if name in own:
                setattr(torch.Tensor, name, fn)
            else:
                delattr(torch.Tensor, name)  # inherited from torch._C.TensorBase
    _count(_nested(raw), counts)
