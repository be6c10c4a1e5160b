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
