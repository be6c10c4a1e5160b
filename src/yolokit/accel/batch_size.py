"""Find the largest batch that fits, predict it from a memory model, survive OOM at run time.

Three tools, all catching ``torch.OutOfMemoryError`` and nothing else:

- :func:`find_batch_size` runs real steps at growing sizes (doubling, then optionally a
  binary search) and returns the largest size that fit, less a safety margin.
- :func:`fit_memory_model` / :func:`predict_batch_size` fit
  ``peak_bytes(b) = fixed + per_sample * b`` from a few small probes and predict the
  size for a target fraction of device memory, cross-checked by a real step and, if
  that step does not fit, by a search below the prediction.
- :class:`OOMGuard` wraps the forward/backward of one optimizer step: on an
  out-of-memory error it discards the partial gradients, halves the micro-batch,
  doubles the number of accumulated micro-batches and retries, so the effective batch
  (and the learning curve) stay the same and the run continues.
"""

from __future__ import annotations

import gc
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from yolokit.accel.distributed import no_sync

INDEX_KEYS = ("targets",)  # batch-dict keys holding flat rows (image_index, ...), see ARCHITECTURE


def free_memory() -> None:
    """Collect garbage and return cached CUDA blocks to the driver."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _fits(step_fn: Callable[[int], Any], size: int) -> bool:
    try:
        step_fn(size)
        ok = True
    except torch.OutOfMemoryError:
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
        while bad - good > 1:
            mid = (good + bad) // 2
            if _fits(step_fn, mid):
                good = mid
            else:
                bad = mid
    return max(1, math.floor(good * (1.0 - margin)))


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


def measure_peak_memory(step_fn: Callable[[int], Any], size: int, *, device: torch.device | str | None = None) -> int:
    """Peak CUDA memory allocated (bytes) while ``step_fn(size)`` runs."""
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        raise ValueError("peak memory can only be measured on CUDA devices")
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
) -> int:
    """Predict the batch size using ``fraction`` of device memory, then check it.

    Args:
        step_fn: ``step_fn(batch_size)`` runs one training step.
        fraction: Share of total device memory the peak may reach (leaves room for the
            CUDA context and allocator fragmentation).
        probe_sizes: Small sizes whose peaks are measured.
        max_size: Upper bound on the result.
        total_bytes: Device memory; defaults to the current CUDA device's total.
        measure: ``measure(b) -> peak bytes``; defaults to :func:`measure_peak_memory`.
        verify: Run one step at the predicted size; if it runs out of memory, return
            ``find_batch_size(..., mode="binsearch", margin=0)`` below the prediction.

    Returns:
        Predicted (and, with ``verify``, confirmed) batch size, at least 1.
    """
    measure = measure or (lambda b: measure_peak_memory(step_fn, b))
    if total_bytes is None:
        total_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    model = fit_memory_model(list(probe_sizes), [measure(b) for b in probe_sizes])
    size = min(max(1, model.batch_size_for(fraction * total_bytes)), max_size)
    if verify and not _fits(step_fn, size):
        start = min(max(probe_sizes), size - 1) if size > 1 else 1
        size = find_batch_size(step_fn, start=max(1, start), max_size=size, mode="binsearch", margin=0.0)
    return size


def _batch_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, dict) and isinstance(batch.get("images"), torch.Tensor):
        return batch["images"].shape[0]
    for v in batch.values() if isinstance(batch, dict) else batch:
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return v.shape[0]
    raise ValueError("cannot find the batch size: no tensor in the batch")


def _slice(value: Any, n: int, lo: int, hi: int, key: Any = None) -> Any:
    if key in INDEX_KEYS and isinstance(value, torch.Tensor) and value.dim() == 2:
        rows = value[(value[:, 0] >= lo) & (value[:, 0] < hi)].clone()
        rows[:, 0] -= lo
        return rows
    if isinstance(value, torch.Tensor):
        return value[lo:hi] if value.dim() > 0 and value.shape[0] == n else value
    if isinstance(value, dict):
        return {k: _slice(v, n, lo, hi, k) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and len(value) == n:
        return value[lo:hi]
    return value


def split_batch(batch: Any, parts: int) -> list[tuple[Any, float]]:
    """Split a batch into ``parts`` micro-batches along the image dimension.

    Tensors whose first dimension is the batch size ``B`` are sliced; in a dict, the
    ``targets`` Tensor[N, 6] rows ``(image_index, class, x1, y1, x2, y2)`` are selected by
    image index and re-indexed from 0; per-image lists (``paths``, ``orig_shapes``) are
    sliced; anything else is passed through. A top-level list/tuple is a tuple of fields.

    Args:
        batch: Tensor[B, ...], a dict (the yolokit batch), or a tuple of fields.
        parts: Number of micro-batches (capped at ``B``); sizes differ by at most one.

    Returns:
        ``(micro_batch, weight)`` pairs with ``weight = micro_size / B``.
    """
    n = _batch_len(batch)
    parts = max(1, min(parts, n))
    sizes = [n // parts + (i < n % parts) for i in range(parts)]
    out, lo = [], 0
    for size in sizes:
        hi = lo + size
        if isinstance(batch, (list, tuple)) and not isinstance(batch, torch.Tensor):
            micro = type(batch)(_slice(v, n, lo, hi) for v in batch)
        else:
            micro = _slice(batch, n, lo, hi)
        out.append((micro, size / n))
        lo = hi
    return out


class OOMGuard:
    """Run one optimizer step's forward/backward, splitting the batch further on OOM.

    The batch given to :meth:`run` is one loader batch (one optimizer step, or one
    micro-step of an outer gradient accumulation). It is cut into ``splits``
    micro-batches; ``fn(micro_batch, weight)`` must run forward and backward on a
    micro-batch with its loss multiplied by ``weight`` (its share of the batch). On
    ``torch.OutOfMemoryError`` the gradients of ``model`` go back to what they were when
    ``run`` started (gradients of earlier accumulation steps survive; a copy is kept only
    while such gradients exist), memory is freed, ``splits`` doubles and the batch is
    retried. Later batches keep the larger split.

    With a loss that is a mean over images, the gradient equals the unsplit one, so the
    weights follow the same path (BatchNorm in train mode sees micro-batch statistics).
    Under DDP the all-reduce runs only on the last micro-batch; recovery is exact when the
    error happens before that synchronising backward starts, which covers all but the
    last micro-batch of the retry.

    Args:
        model: The model being trained (possibly DDP-wrapped).
        min_micro_batch: Give up (re-raise) rather than split below this size.

    Example:
        >>> model = nn.Linear(4, 1)
        >>> guard = OOMGuard(model)
        >>> def micro_step(micro, weight):  # forward + backward of one micro-batch
        ...     x, y = micro
        ...     (nn.functional.mse_loss(model(x), y) * weight).backward()
        ...     return len(x)
        >>> guard.run(micro_step, (torch.randn(8, 4), torch.randn(8, 1)))  # then step, zero_grad
        [8]
    """

    def __init__(self, model: nn.Module, *, min_micro_batch: int = 1) -> None:
        self.model = model
        self.min_micro_batch = min_micro_batch
        self.splits = 1
        self.recoveries = 0

    def micro_batch(self, batch_size: int) -> int:
        """Largest micro-batch used for a batch of ``batch_size`` at the current split."""
        return math.ceil(batch_size / self.splits)

    def run(self, fn: Callable[[Any, float], Any], batch: Any) -> list[Any]:
        """Run ``fn`` over the micro-batches of ``batch``; retry with smaller ones on OOM.

        Args:
            fn: ``fn(micro_batch, weight)``; does forward and backward, returns anything.
            batch: The batch of one optimizer step (see :func:`split_batch`).

        Returns:
            The values ``fn`` returned, one per micro-batch of the successful attempt.
        """
        n = _batch_len(batch)
        kept = self._kept_gradients()
        while True:
            try:
                return self._attempt(fn, batch)
            except torch.OutOfMemoryError:
                if self.micro_batch(n) <= self.min_micro_batch:
                    raise
            self._recover(n, kept)

    def _kept_gradients(self) -> list[torch.Tensor | None] | None:
        """Copies of gradients accumulated before this batch (an outer accumulation), if any."""
        grads = [p.grad for p in self.model.parameters()]
        if all(g is None for g in grads):
            return None
        return [None if g is None else g.detach().clone() for g in grads]

    def _attempt(self, fn: Callable[[Any, float], Any], batch: Any) -> list[Any]:
        chunks = split_batch(batch, self.splits)
        out = []
        for i, (micro, weight) in enumerate(chunks):
            with no_sync(self.model, enabled=i < len(chunks) - 1):
                out.append(fn(micro, weight))
        return out

    def _recover(self, n: int, kept: list[torch.Tensor | None] | None) -> None:
        for i, p in enumerate(self.model.parameters()):
            p.grad = None if kept is None or kept[i] is None else kept[i].clone()
        free_memory()
        self.splits *= 2
        self.recoveries += 1
        warnings.warn(
            f"out of memory: retrying with {self.splits} micro-batches of <= {self.micro_batch(n)} "
            "images (effective batch unchanged)",
            RuntimeWarning,
            stacklevel=3,
        )
