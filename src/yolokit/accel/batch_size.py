"""Find the largest batch that fits, and predict it from a memory model.

Both tools treat as out-of-memory what :func:`is_oom_error` says is one
(``torch.OutOfMemoryError``, and the allocation failures cuDNN and cuBLAS report as
``RuntimeError``):

- :func:`find_batch_size` runs real steps at growing sizes (doubling, then optionally a
  binary search) and returns the largest size that fit, less a safety margin.
- :func:`fit_memory_model` / :func:`predict_batch_size` fit
  ``peak_bytes(b) = fixed + per_sample * b`` from a few small probes and predict the
  size for a target fraction of device memory, cross-checked by a real step and, if
  that step does not fit, by a search below the prediction.

Surviving an out-of-memory error mid-run (same effective batch, smaller micro-batches)
is :mod:`yolokit.accel.oom`'s job.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from yolokit.accel.oom import free_memory, is_oom_error


def _fits(step_fn: Callable[[int], Any], size: int) -> bool:
    try:
        step_fn(size)
        ok = True
    except Exception as exc:
        if not is_oom_error(exc):
            raise
        ok = False  # leaving the except block drops the traceback and the tensors it holds
    free_memory()
    return ok


def find_batch_size(
    step_fn: Callable[[int], Any],
    *,
    start: int = 1,
    max_size: int = 1024,
    mode: str = "power",
    margin: float = 0.1,
) -> int:
    """Largest batch size for which ``step_fn`` runs without running out of memory.

    Sizes ``start, 2*start, 4*start, ...`` are tried until one fails or ``max_size`` is
    reached; ``"binsearch"`` then bisects between the last size that fit and the first
    that did not. Memory is freed between trials. ``step_fn`` should do what a training
    step does (forward, backward, optimizer step), so it changes the model: run the search
    on a copy, or reload the weights afterwards.

    Args:
        step_fn: ``step_fn(batch_size)`` runs one step at that size.
        start: First size tried; must fit.
        max_size: Largest size tried.
        mode: ``"power"`` (doubling only) or ``"binsearch"`` (doubling, then bisection).
        margin: Fraction taken off the largest fitting size, as headroom for batches
            that need more memory than the probe (more targets, fragmentation).

    Returns:
        ``max(1, floor(largest_fitting * (1 - margin)))``.
    """
    if mode not in ("power", "binsearch"):
        raise ValueError(f"mode must be 'power' or 'binsearch', got {mode!r}")
    if not 1 <= start <= max_size:
        raise ValueError(f"need 1 <= start <= max_size, got start={start}, max_size={max_size}")
    if not _fits(step_fn, start):
        raise RuntimeError(f"batch size {start} does not fit in memory")
    good, bad = start, None
    while good < max_size:
        size = min(2 * good, max_size)
        if _fits(step_fn, size):
            good = size
        else:
            bad = size
            break
    if mode == "binsearch" and bad is not None:
        good = bisect_fitting(step_fn, good, bad)
    return max(1, math.floor(good * (1.0 - margin)))


def bisect_fitting(step_fn: Callable[[int], Any], good: int, bad: int) -> int:
    """The largest size in ``[good, bad)`` for which ``step_fn`` runs, ``good`` known to fit and ``bad``
    known not to (neither is run again): bisection, memory freed between trials."""
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if _fits(step_fn, mid) else (good, mid)
    return good


@dataclass(frozen=True)
class MemoryModel:
    """Linear model of peak memory against batch size: ``fixed + per_sample * b`` bytes."""

    fixed_bytes: float
    per_sample_bytes: float

    def predict(self, batch_size: int) -> float:
        """Predicted peak bytes at ``batch_size``."""
        return self.fixed_bytes + self.per_sample_bytes * batch_size

    def batch_size_for(self, budget_bytes: float) -> int:
        """Largest batch whose predicted peak is within ``budget_bytes`` (0 if none)."""
        if self.per_sample_bytes <= 0:
            raise ValueError("memory does not grow with batch size; cannot predict a size")
        size = (budget_bytes - self.fixed_bytes) / self.per_sample_bytes
        return max(0, math.floor(round(size, 6)))  # round off least-squares noise before flooring


def fit_memory_model(sizes: Sequence[int], peak_bytes: Sequence[float]) -> MemoryModel:
    """Least-squares fit of :class:`MemoryModel` to probes.

    Args:
        sizes: Batch sizes probed (at least two distinct).
        peak_bytes: Peak memory measured at each size.

    Returns:
        The fitted model.
    """
    if len(set(sizes)) < 2 or len(sizes) != len(peak_bytes):
        raise ValueError("need peak memory for at least two distinct batch sizes")
    b = torch.tensor(sizes, dtype=torch.float64)
    a = torch.stack([torch.ones_like(b), b], dim=1)  # [N, 2]
    y = torch.tensor(peak_bytes, dtype=torch.float64)[:, None]  # [N, 1]
    coef = torch.linalg.lstsq(a, y).solution[:, 0]
    return MemoryModel(float(coef[0]), float(coef[1]))


def measure_peak_memory(step_fn: Callable[[int], Any], size: int, *, device: torch.device | str | None = None,
                        warmup: int = 1) -> int:
    """Peak CUDA memory allocated (bytes) while ``step_fn(size)`` runs, measured after ``warmup`` runs.

    The first run at a size allocates what later ones do not (cuDNN's benchmark trying
    algorithms and their workspaces, cuBLAS handles and workspaces, lazily built kernels), or
    less (an algorithm picked later needs more); the run that counts is the one after, as
    every step of training is.
    """
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        raise ValueError("peak memory can only be measured on CUDA devices")
    for _ in range(warmup):
        step_fn(size)
    free_memory()
    torch.cuda.reset_peak_memory_stats(device)
    step_fn(size)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free_memory()
    return peak


def predict_batch_size(
    step_fn: Callable[[int], Any],
    *,
    fraction: float = 0.8,
    probe_sizes: Sequence[int] = (1, 2, 4, 8),
    max_size: int = 1024,
    total_bytes: float | None = None,
    measure: Callable[[int], float] | None = None,
    verify: bool = True,
    refine: bool = True,
) -> int:
    """Predict the batch size using ``fraction`` of device memory, then check it.

    A line through small probes extrapolates far: on an H100 (yolov8s, 2026-11-27) probes of 1-8
    images gave 199.6 MiB an image where 412 images took 195, so the prediction fell 2% short.
    With ``refine`` the first prediction is itself measured, and the line through it and the
    largest probe gives the answer: the slope over the range that matters (one more size tried).

    Args:
        step_fn: ``step_fn(batch_size)`` runs one training step.
        fraction: Share of total device memory the peak may reach (leaves room for the
            CUDA context and allocator fragmentation).
        probe_sizes: Small sizes whose peaks are measured.
        max_size: Upper bound on the result.
        total_bytes: Device memory; defaults to the current CUDA device's total.
        measure: ``measure(b) -> peak bytes``; defaults to :func:`measure_peak_memory`.
        verify: Run one step at the predicted size (unless a measure already ran it); if it runs
            out of memory, bisect between the largest size known to fit and it (`bisect_fitting`).
        refine: Measure the first prediction (when it is over twice the largest probe) and predict
            again from it and the largest probe. A size at or below one measured is not run again.

    Returns:
        Predicted (and, with ``verify``, confirmed) batch size, at least 1.
    """
    measure = measure or (lambda b: measure_peak_memory(step_fn, b))
    if total_bytes is None:
        total_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    sizes = list(probe_sizes)
    peaks = [measure(b) for b in sizes]
    model = fit_memory_model(sizes, peaks)
    size = min(max(1, model.batch_size_for(fraction * total_bytes)), max_size)
    fitted, failed = max(sizes), None   # the largest size known to fit, one known not to
    if refine and size > 2 * max(sizes):
        peak = _measured(measure, size)
        if peak is None:
            failed = size
        else:
            fitted = size
            top = sizes.index(max(sizes))
            model = fit_memory_model([sizes[top], size], [peaks[top], peak])
            size = min(max(1, model.batch_size_for(fraction * total_bytes)), max_size)
    if verify and size > fitted and (size == failed or not _fits(step_fn, size)):
        size = max(1, bisect_fitting(step_fn, fitted, size))
    return size


def _measured(measure: Callable[[int], float], size: int) -> float | None:
    """``measure(size)``, or None when that size runs out of memory."""
    try:
        peak = measure(size)
    except Exception as exc:
        if not is_oom_error(exc):
            raise
        peak = None
    free_memory()
    return peak
