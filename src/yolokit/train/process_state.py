"""What a run changes in its process, put back when it ends: a notebook's kernel stays as it was.

A run seeds Python's, NumPy's and torch's global generators (``seed_everything``), turns on
deterministic kernels on the CPU (``accel.perf.configure``), sets cuDNN's and TF32's switches, may
change torch's thread count, and installs signal handlers while it trains. In a script that ends
with the run, none of it matters; in a Jupyter kernel or a test session the next cell would draw
the same "random" numbers and run with the run's kernels. :func:`left_as_found` captures all of
it before a run and restores it after, however the run ends (finished, failed or interrupted).

Example::

    with left_as_found():
        Trainer(config).fit()
    random.random()        # as if the run had never happened
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import random
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass
class ProcessState:
    """The process-wide settings a run may change (see :func:`left_as_found`)."""

    deterministic: bool
    deterministic_warn_only: bool
    fill_uninitialized_memory: bool
    cudnn_deterministic: bool
    cudnn_benchmark: bool
    cudnn_allow_tf32: bool
    matmul_allow_tf32: bool
    float32_matmul_precision: str
    num_threads: int
    python_rng: Any = field(repr=False)
    numpy_rng: Any = field(repr=False)
    torch_rng: torch.Tensor = field(repr=False)
    cuda_rng: list[torch.Tensor] | None = field(repr=False)
    cuda_device: int | None
    handlers: dict[int, Any] = field(repr=False)
    unraisablehook: Any = field(repr=False)
    grad_enabled: bool = True

    @classmethod
    def capture(cls) -> ProcessState:
        """The settings as they are now."""
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        in_main = _main_thread()
        return cls(
            deterministic=torch.are_deterministic_algorithms_enabled(),
            deterministic_warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
            fill_uninitialized_memory=torch.utils.deterministic.fill_uninitialized_memory,
            cudnn_deterministic=torch.backends.cudnn.deterministic,
            cudnn_benchmark=torch.backends.cudnn.benchmark,
            cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
            matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
            float32_matmul_precision=torch.get_float32_matmul_precision(),
            num_threads=torch.get_num_threads(),
            python_rng=random.getstate(), numpy_rng=np.random.get_state(), torch_rng=torch.get_rng_state(),
            cuda_rng=torch.cuda.get_rng_state_all() if cuda else None,
            cuda_device=torch.cuda.current_device() if cuda else None,
            handlers={s: signal.getsignal(s) for s in SIGNALS} if in_main else {},
            unraisablehook=sys.unraisablehook, grad_enabled=torch.is_grad_enabled())

    def restore(self) -> None:
        """Puts every setting back (a generator's state, a handler: what :meth:`capture` saw)."""
        torch.use_deterministic_algorithms(self.deterministic, warn_only=self.deterministic_warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = self.fill_uninitialized_memory
        torch.backends.cudnn.deterministic = self.cudnn_deterministic
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        torch.backends.cuda.matmul.allow_tf32 = self.matmul_allow_tf32    # before the precision: it sets both
        torch.backends.cudnn.allow_tf32 = self.cudnn_allow_tf32
        torch.set_float32_matmul_precision(self.float32_matmul_precision)
        if torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)
        random.setstate(self.python_rng)
        np.random.set_state(self.numpy_rng)
        torch.set_rng_state(self.torch_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        if self.cuda_device is not None:
            torch.cuda.set_device(self.cuda_device)
        if _main_thread():
            for sig, handler in self.handlers.items():
                if handler is not None and signal.getsignal(sig) is not handler:   # None: not set from Python
                    signal.signal(sig, handler)
        sys.unraisablehook = self.unraisablehook
        torch.set_grad_enabled(self.grad_enabled)

    def differences(self, other: ProcessState) -> list[str]:
        """The names of the settings that differ from ``other``'s (generators compared by their state)."""
        return [f.name for f in fields(self) if not _same(getattr(self, f.name), getattr(other, f.name))]


@contextlib.contextmanager
def left_as_found() -> Iterator[ProcessState]:
    """Restores on exit what :class:`ProcessState` covers, as it was on entry (whatever ends the block).

    Environment variables the block added for cuBLAS (``CUBLAS_WORKSPACE_CONFIG``) stay: cuBLAS read
    them when the block first used it, and a later deterministic run needs them set."""
    before = ProcessState.capture()
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    try:
        yield before
    finally:
        before.restore()
        if cublas is not None:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas


def release_memory() -> None:
    """Gives back what a finished run's objects held: their reference cycles collected, the C heap's free
    pages returned to the system (glibc's ``malloc_trim``; elsewhere nothing), CUDA's cached blocks freed."""
    gc.collect()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    return a is b or a == b
