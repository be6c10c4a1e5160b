"""A small cache of constant tensors keyed by shape, dtype and device (grids, anchors, strides)."""

from __future__ import annotations

from typing import Any

import torch


class ConstantCache:
    """Constant tensors (grids, anchors, strides) built once per key: map sizes, dtype, device.

    What a head's ``decode`` or a loss would otherwise rebuild, and copy from the host to the
    device (a blocking copy on CUDA), on every call.

    Kept as plain attributes (not buffers, not in the state dict) and made outside
    inference mode, so a grid first built under ``torch.inference_mode()`` still works in
    an autograd pass later. Tracing and compiling (ONNX export, torch.compile) bypass it.
    """

    def __init__(self, size: int = 8):
        self.size, self.store = size, {}

    def get(self, key: tuple, make: Any) -> Any:
        if torch.compiler.is_compiling() or torch.jit.is_tracing():  # export/compile: grids stay in the graph
            return make()
        found = self.store.get(key)
        if found is None:
            with torch.inference_mode(False), torch.no_grad():
                found = make()
            if len(self.store) >= self.size:
                self.store.clear()
            self.store[key] = found
        return found


def upload(data: Any, dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """Host values (numbers, nested lists) as a tensor on ``device``, without making the host wait.

    ``torch.tensor(data, device="cuda")`` copies from pageable memory and waits for the stream
    to catch up; here, on CUDA, the values go through pinned memory with an asynchronous copy
    (the pinned block is not reused before the copy has run). Meant for the constants that
    ``ConstantCache`` builds once per key.

    Examples:
        >>> upload([[10.0, 13.0], [16.0, 30.0]]).shape
        torch.Size([2, 2])
    """
    device = torch.device(device)
    if torch.compiler.is_compiling() or torch.jit.is_tracing():   # a constant of the graph
        return torch.tensor(data, dtype=dtype, device=device)
    host = torch.tensor(data, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
