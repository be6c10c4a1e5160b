"""The device augmentation's own CUDA stream: the decoder never writes a block a queued kernel still reads.

torchvision's ``decode_jpeg(..., device="cuda")`` allocates its outputs on the current stream and
has nvJPEG write them on a private stream, which it orders before the current stream's later work
(an event) but not after the work already queued there. The caching allocator hands out a block as
soon as the tensor in it is freed on its stream, while kernels queued on that stream may still read
it; the decoder can then write over memory those kernels read: wrong numbers, NaNs, or a device-side
assert in code that never touched the decoder (seen on an H100: an ``index out of bounds`` assert
at random in the pass, none with ``CUDA_LAUNCH_BLOCKING=1``).

So the pass runs on a stream of its own (one per device, `on_pass_stream`), where only the pass
queues work. Before a pass, the host waits for the previous pass's event (`_PassStream.drain`): by
then it has almost always ended, and the training stream is never waited for. The caller's stream
waits for the pass through an event, and the tensors the pass returns are marked as used by the
caller's stream (``record_stream``), so the pass never reuses their blocks before the caller's work
on them has run. The batch's host arrays stay referenced until the pass's event, so no pinned or
shared-memory buffer is reused while the decoder may still read its bytes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


class _PassStream:
    """The pass's stream on one device, the event after its last pass, and the host arrays that pass read."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self.done: torch.cuda.Event | None = None
        self.held: tuple = ()

    def drain(self) -> None:
        """Wait (host side) until every pass queued here has run: then no block of this stream's pool is
        still read by a queued kernel, and the decoder may write any block it is given."""
        if self.done is not None and not self.done.query():
            self.done.synchronize()
        self.done, self.held = None, ()


_STREAMS: dict[torch.device, _PassStream] = {}


def _pass_stream(device: torch.device) -> _PassStream:
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if device not in _STREAMS:
        _STREAMS[device] = _PassStream(device)
    return _STREAMS[device]


def on_pass_stream(fn: Callable[[dict, torch.device], Any], batch: dict, device: torch.device) -> Any:
    """``fn(batch, device)``; on CUDA on the pass's own stream, with the caller's current stream made to
    wait for it and the tensors it returns (one, or a tuple) marked as used by the caller's stream."""
    if device.type != "cuda":
        return fn(batch, device)
    own = _pass_stream(device)
    caller = torch.cuda.current_stream(device)
    own.drain()                                   # the previous pass has run: its blocks may be written
    own.held = tuple(v for v in batch.values() if isinstance(v, (torch.Tensor, np.ndarray)))
    try:
        with torch.cuda.stream(own.stream):
            out = fn(batch, device)
    finally:                                      # what was queued, even by a pass that raised, is waited for
        own.done = torch.cuda.Event()
        own.done.record(own.stream)
    caller.wait_event(own.done)
    for t in out if isinstance(out, tuple) else (out,):      # the tensors among what it returns
        if getattr(t, "is_cuda", False):
            t.record_stream(caller)
    return out


def settle(device: torch.device) -> None:
    """On CUDA, wait (host side, through an event) for the work queued on the current stream: the pass's,
    before a decode retried on the failure path."""
    if device.type == "cuda":
        done = torch.cuda.Event()
        done.record()
        done.synchronize()


# torchvision reports a failed CUDA call inside the decoder as a plain RuntimeError with these words
_DEVICE_ERROR = re.compile(r"CUDA error|cudaError|CUDA stream|CUDA_ERROR")


def raise_if_the_device_failed(err: RuntimeError, device: torch.device, names: list[str]) -> None:
    """Re-raise when the device, not a file, failed: a ``torch.AcceleratorError``, torchvision's message
    about a CUDA call, or any error after which the device reports one (asked once, on this failure path
    only). Returns for a damaged file, which the caller then decodes another way."""
    if isinstance(err, torch.AcceleratorError) or _DEVICE_ERROR.search(str(err)):
        raise err
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)
        except RuntimeError as broken:            # the CUDA error itself, not a bad file
            files = ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
            raise broken from RuntimeError(f"while decoding the batch's JPEG files ({files}): {err}")
