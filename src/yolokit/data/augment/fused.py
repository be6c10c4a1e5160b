"""The device pass's per-pixel stages compiled into a few fused kernels (``compiled=True``).

`device_augment` and `color` write each per-pixel stage (resize, warp, MixUp, HSV) as one function of
tensors. Run eagerly, each tensor operation of a stage is a kernel that reads and writes the whole
chunk (the warp alone moves about 5 KB per output pixel); `stage(fn, True)` gives the same function
through ``torch.compile``, which fuses it into a kernel or two (Triton on CUDA, C++ on the CPU) that
reads its sources and writes its output. For that the stages keep nothing per pixel between steps
(no stacked neighbours or channels: each is a term of a sum, gathered where it is used), and
`OPTIONS` tells inductor to recompute a value several expressions read rather than store it.

The numbers stay OpenCV's: the stages are written so that no step depends on how the compiler
groups them (the float64 product in the HSV step is exact before its one rounding), and the compile
keeps every cast eager has (``emulate_precision_casts``, which also keeps Triton from fusing a
multiply and an add into one rounding). tests/data/test_fused_pass.py checks the compiled pass
against the eager one bit for bit on the CPU; the gpu test does on CUDA.

Each stage compiles once per process with dynamic shapes, on its first call (about 100 s for all
four on this machine's 2 CPU cores; a GPU machine's time is measured by the GPU pass's ``fused``
section). Batches of other sizes and shapes, one view or two, JPEGs or cached pixels reuse the
kernels; only a batch of a single image compiles once more (PyTorch specialises sizes 0 and 1).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

OPTIONS = {"emulate_precision_casts": True,
           # recompute, don't store: a value several expressions read (a warp's source point, a corner's
           # index) stays inside the kernel that writes the output instead of becoming a per-pixel buffer;
           # what it reads is a few small tables and the sources, so recomputing costs arithmetic, not bytes
           "realize_reads_threshold": 64, "realize_acc_reads_threshold": 64, "realize_cpu_acc_reads_threshold": 64,
           "realize_opcount_threshold": 1000, "realize_cpu_opcount_threshold": 1000}
_compiled: dict[Callable, Callable] = {}


def options() -> dict:
    """`OPTIONS` that this torch's inductor knows (an older release lacks the CPU twins, and
    ``torch.compile`` refuses a name it does not know)."""
    from torch._inductor import config

    return {k: v for k, v in OPTIONS.items() if hasattr(config, k)}


def stage(fn: Callable, compiled: bool) -> Callable:
    """``fn`` itself, or (``compiled``) its ``torch.compile``d twin, made once per process.

    Its sizes are symbols that equal values do not tie (no duck sizing: a square batch would
    otherwise compile a kernel for height == width, and a rect batch compile again)."""
    if not compiled:
        return fn
    if fn not in _compiled:
        _compiled[fn] = _untied(torch.compile(fn, dynamic=True, fullgraph=True, options=options()))
    return _compiled[fn]


def _untied(compiled: Callable) -> Callable:
    from torch.fx.experimental import _config as fx_config

    def run(*args, **kwargs):
        with fx_config.patch(use_duck_shape=False):
            return compiled(*args, **kwargs)

    return run
