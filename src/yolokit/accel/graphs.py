"""A whole training step as a CUDA graph: recorded once per shape, then replayed with one launch.

A step of a small network (yolov8n) is thousands of short kernels launched one by one from
Python, and the host cannot launch them as fast as the GPU runs them: the GPU waits. A CUDA
graph records the step's kernels (forward, loss, backward, gradient clipping, the optimizer's
update) once and replays them all with a single launch. A replay runs the recorded kernels on the
recorded memory with the recorded numbers, and nothing else:

- **Inputs** are copied into the graph's own buffers first (:class:`StepGraphs` does it).
- **Numbers** the step takes from Python (each group's learning rate and momentum, the batch's
  size) are frozen into the kernels' arguments. Every such number is part of the graph's key,
  so a step whose numbers changed gets a graph of its own. A learning rate that changes every
  step (the warmup) therefore never repeats a key, and those steps run as they are.
- **State** must be changed in place. A step that replaces a tensor (``self.x = self.x + 1``)
  keeps pointing at the tensor made while recording, and every replay starts again from
  the old one. :class:`StepGraphs` cannot see that; the CPU stand-in in the tests can
  (``tests/_graph_tape.py``: the same contract with ``make_fx``, whose replays freeze Python
  numbers and tensors exactly as a CUDA graph does).
- **Shapes** are static and nothing is read back from the device: a step that waits for the host
  cannot be recorded.

Usage::

    graphs = StepGraphs(step, device)          # step(variant, **inputs) -> dict of small tensors
    for batch in loader:
        out = graphs({"images": x, "labels": y}, variant=(lr, momentum))

A key (the variant and the inputs' shapes, dtypes and strides) runs eagerly ``warmup`` times
(lazy allocations such as optimizer state and cuDNN's benchmark happen then), is recorded on the
next sighting, and is replayed from then on. The graphs share one memory pool: they never run
at the same time, and a step must not keep a tensor it allocated while being recorded (the
warmup runs allocate everything that lasts). At most ``max_graphs`` graphs are kept, the least
recently used dropped first.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

Step = Callable[..., dict[str, Tensor]]


class GraphCaptureError(RuntimeError):
    """Recording the step as a CUDA graph failed (nothing of the step ran on the device)."""


def bucket(n: int, smallest: int = 8) -> int:
    """The static size a count of ``n`` is padded to: the next power of two, at least ``smallest``.

    Examples:
        >>> [bucket(n) for n in (0, 8, 9, 33)]
        [8, 8, 16, 64]
    """
    return max(smallest, 1 << max(0, int(n) - 1).bit_length())


class Backend(Protocol):
    """How graphs are recorded and replayed on one device (CUDA here; the tests bring a CPU stand-in)."""

    runs_while_recording: bool   # whether recording also runs the step once (CUDA's does not)

    def eager(self, fn: Callable[[], Any]) -> Any: ...
    def record(self, fn: Callable[[], dict[str, Tensor]]) -> tuple[Callable[[], None], dict[str, Tensor]]: ...


class CudaBackend:
    """``torch.cuda.CUDAGraph`` on a side stream, all graphs in one memory pool.

    Warmup runs and recordings use the same side stream (its cuBLAS workspace is made during
    the warmup, not while recording), which first waits for the current stream; the current
    stream then waits for it. Recording errors only for this thread's calls
    (``capture_error_mode="thread_local"``): the loader's pinning thread goes on.
    """

    runs_while_recording = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()

    def eager(self, fn: Callable[[], Any]) -> Any:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            out = fn()
        current.wait_stream(self.stream)
        return out

    def record(self, fn: Callable[[], dict[str, Tensor]]) -> tuple[Callable[[], None], dict[str, Tensor]]:
        graph = torch.cuda.CUDAGraph()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            out = fn()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return graph.replay, out


_BACKENDS: dict[str, Callable[[torch.device], Backend]] = {"cuda": CudaBackend}


def backend_for(device: torch.device | str) -> Callable[[torch.device], Backend] | None:
    """The graph backend of ``device``'s type (CUDA's), or None where graphs cannot be recorded."""
    return _BACKENDS.get(torch.device(device).type)


def register_backend(device_type: str, make: Callable[[torch.device], Backend] | None) -> None:
    """Record graphs on ``device_type`` with ``make(device)`` (None: remove). The tests register a
    CPU stand-in that replays a traced step, to check on the CPU what a CUDA graph would do."""
    if make is None:
        _BACKENDS.pop(device_type, None)
    else:
        _BACKENDS[device_type] = make


@dataclass
class _Graph:
    replay: Callable[[], None]
    inputs: dict[str, Tensor]
    outputs: dict[str, Tensor]


@dataclass
class GraphStats:
    """What a :class:`StepGraphs` did so far."""

    eager: int = 0        # steps run as they are (a key's warmup, or a key not yet seen enough)
    recorded: int = 0     # graphs recorded
    replays: int = 0      # steps replayed from a graph
    dropped: int = 0      # graphs dropped to keep at most ``max_graphs``


class StepGraphs:
    """A step recorded as one graph per key and replayed (see the module docstring).

    Args:
        step: ``step(variant, **inputs) -> {name: tensor}``. It must change state in place,
            read nothing back from the device and allocate nothing it keeps; what it returns is
            small (the loss's parts) and is copied out after each replay.
        device: where the step runs.
        warmup: eager runs of a key before it is recorded.
        max_graphs: graphs kept (least recently used dropped first).
        backend: how graphs are recorded; default: the device type's (:func:`backend_for`).

    Raises:
        ValueError: no backend records graphs on ``device``.
    """

    def __init__(self, step: Step, device: torch.device | str, *, warmup: int = 2, max_graphs: int = 8,
                 backend: Backend | None = None) -> None:
        self.device = torch.device(device)
        if backend is None:
            make = backend_for(self.device)
            if make is None:
                raise ValueError(f"CUDA graphs cannot be recorded on {self.device.type}: they need a CUDA device")
            backend = make(self.device)
        if warmup < 1 or max_graphs < 1:
            raise ValueError(f"warmup and max_graphs must be >= 1, got {warmup}, {max_graphs}")
        self.step, self.backend, self.warmup, self.max_graphs = step, backend, warmup, max_graphs
        self.stats = GraphStats()
        self.failed: str | None = None   # set by a caller that stopped using the graphs, and why
        self._graphs: OrderedDict[Hashable, _Graph] = OrderedDict()
        self._seen: OrderedDict[Hashable, int] = OrderedDict()
        self._buffers: dict[Hashable, Tensor] = {}

    def __repr__(self) -> str:
        return f"StepGraphs(graphs={len(self._graphs)}, warmup={self.warmup}, stats={self.stats})"

    @property
    def graphs(self) -> int:
        """Graphs held now."""
        return len(self._graphs)

    def clear(self) -> None:
        """Drop every graph and what was seen (their memory goes back to the pool)."""
        self._graphs.clear()
        self._seen.clear()
        self._buffers.clear()

    def _buffer(self, name: str, t: Tensor) -> Tensor:
        """The static input buffer for ``name`` at ``t``'s shape, dtype and strides, shared by every graph
        that takes such an input (graphs never run at the same time, and each replay copies its inputs in
        first): a batch of 64 images at 640 is 315 MB, not to be held once per graph."""
        key = (name, tuple(t.shape), t.dtype, t.stride(), t.device)
        if key not in self._buffers:
            self._buffers[key] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        return self._buffers[key]

    def __call__(self, inputs: dict[str, Tensor], *, variant: Hashable = ()) -> dict[str, Tensor]:
        """One step on ``inputs``: eager, recorded, or replayed. Returns the step's outputs (fresh
        tensors when replayed: a later replay does not change them)."""
        key = (variant, tuple((name, tuple(t.shape), t.dtype, t.stride(), t.device)
                              for name, t in sorted(inputs.items())))
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
            for name, t in inputs.items():
                graph.inputs[name].copy_(t)
            graph.replay()
            self.stats.replays += 1
            return {k: v.clone() for k, v in graph.outputs.items()}
        seen = self._seen.pop(key, 0) + 1
        self._seen[key] = seen
        while len(self._seen) > 8 * self.max_graphs:   # keys of a learning-rate warmup are seen once each
            self._seen.popitem(last=False)
        if seen <= self.warmup:
            self.stats.eager += 1
            return self.backend.eager(lambda: self.step(variant, **inputs))
        static = {name: self._buffer(name, t).copy_(t) for name, t in inputs.items()}
        try:
            replay, outputs = self.backend.record(lambda: self.step(variant, **static))
        except Exception as exc:
            raise GraphCaptureError(f"recording the step as a CUDA graph failed: {type(exc).__name__}: {exc}") from exc
        self.stats.recorded += 1
        self._graphs[key] = _Graph(replay, static, outputs)
        if len(self._graphs) > self.max_graphs:
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
                self.stats.dropped += 1
            used = {id(t) for g in self._graphs.values() for t in g.inputs.values()}
            self._buffers = {k: t for k, t in self._buffers.items() if id(t) in used}
        if not self.backend.runs_while_recording:
            replay()
            self.stats.replays += 1
        return {k: v.clone() for k, v in outputs.items()}


def recording() -> bool:
    """Whether the current CUDA stream is recording a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def capturable(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """While a graph is being recorded: the optimizer's groups say ``capturable`` (torch's Adam and
    AdamW refuse to be recorded otherwise; their fused kernels are the same either way). Outside a
    recording it changes nothing (a capturable optimizer run eagerly warns)."""
    if not recording():
        yield
        return
    groups = [g for g in optimizer.param_groups if "capturable" in g]
    before = [g["capturable"] for g in groups]
    for g in groups:
        g["capturable"] = True
    try:
        yield
    finally:
        for g, b in zip(groups, before, strict=True):
            g["capturable"] = b
