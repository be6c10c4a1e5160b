"""Out of memory in the middle of a run: what counts as one, and how a step survives it.

The :class:`~yolokit.accel.accumulation.Accumulator` keeps the loader batches of the step in
progress (by reference: nothing is copied while nothing fails). When a forward or backward
runs out of memory, :func:`recover` drops the step's gradients and what its forwards did to
BatchNorm running statistics, halves the micro-batches, and hands back the step's earlier
batches to run again, so the step ends with the same effective batch. :func:`run_batch` is
that loop::

    outputs = run_batch(acc, batch, forward_backward)   # forward_backward(micro) of each micro-batch

An out-of-memory error inside ``optimizer.step`` is retried once, one parameter at a time
(:func:`retry_step`); several processes then continue from rank 0's state (:func:`resync`).
"""

from __future__ import annotations

import gc
import re
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from yolokit.accel.distributed import host_group


class Accumulator(Protocol):
    """What this module uses of a :class:`yolokit.accel.accumulation.Accumulator` (a protocol, so that
    ``oom`` need not import ``accumulation``, which imports ``reduce``, which imports ``oom``)."""

    model: nn.Module
    world_size: int
    splits: int
    recoveries: int
    step_retries: int
    min_micro_batch: int
    held: list[Any]
    batchnorm: Any

    def micro_batches(self, batch: Any) -> list[Any]: ...
    def micro_size(self, batch: Any) -> int: ...
    def ran(self, batch: Any) -> None: ...
    def drop_step(self) -> None: ...

# How cuDNN, cuBLAS, the CUDA runtime and NCCL report a failed allocation: a RuntimeError (NCCL's
# DistBackendError is one), not torch.OutOfMemoryError. "CUDA error: out of memory" comes from a
# kernel launch or a library's own cudaMalloc; NCCL says "Cuda failure 'out of memory'".
_ALLOC_FAILURES = re.compile(
    r"CUDNN_STATUS_ALLOC_FAILED|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_NOT_ENOUGH_WORKSPACE"
    r"|cudaErrorMemoryAllocation|(?i:cuda)[^\n]*out of memory")


def is_oom_error(exc: BaseException) -> bool:
    """Whether ``exc`` means the device ran out of memory.

    True for ``torch.OutOfMemoryError`` and for the ``RuntimeError`` others raise when their
    own allocation fails: cuDNN and cuBLAS (``CUDNN_STATUS_ALLOC_FAILED``,
    ``CUBLAS_STATUS_ALLOC_FAILED``, ``CUDNN_STATUS_NOT_ENOUGH_WORKSPACE``), the CUDA runtime
    (``CUDA error: out of memory``, ``cudaErrorMemoryAllocation``) and NCCL (a
    ``DistBackendError`` saying ``Cuda failure 'out of memory'``).

    Examples:
        >>> is_oom_error(RuntimeError("CUDA error: out of memory"))
        True
        >>> is_oom_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
        False
    """
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and _ALLOC_FAILURES.search(str(exc)) is not None


def free_memory() -> None:
    """Collect garbage and return cached CUDA blocks to the driver."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_batch(acc: Accumulator, batch: Any, fn: Callable[[Any], Any]) -> list[Any]:
    """``fn`` over ``batch``'s micro-batches; out of memory: the step's batches again, split finer.

    On an out-of-memory error the step's gradients are dropped, its micro-batches halve
    (:func:`recover`), and its loader batches run again, this one last: the step keeps its
    effective batch. Afterwards ``batch`` counts towards the step (``acc.ran``).

    Args:
        acc: The Accumulator of the step.
        batch: One loader batch, as the loader gave it (kept by reference for a replay).
        fn: Forward and backward of one micro-batch.

    Returns:
        What ``fn`` returned for this batch's micro-batches.
    """
    replay: list[Any] = []
    while True:
        try:
            for held in replay:                          # after out of memory: the step's earlier batches
                for micro in acc.micro_batches(held):
                    fn(micro)
            outputs = [fn(micro) for micro in acc.micro_batches(batch)]
            break
        except Exception as exc:
            if not recoverable(acc, batch, exc):
                raise
        replay = recover(acc, batch)                     # outside `except`: the failed step's tensors are freed
    acc.ran(batch)
    return outputs


def recoverable(acc: Accumulator, batch: Any, exc: BaseException) -> bool:
    """Whether ``exc``, raised in the forward or backward of ``batch``, is an out-of-memory error the
    step survives: the micro-batches are still larger than ``acc.min_micro_batch``."""
    return is_oom_error(exc) and acc.micro_size(batch) > acc.min_micro_batch


def recover(acc: Accumulator, batch: Any) -> list[Any]:
    """After out of memory in the forward or backward of ``batch``: the step's batches to run again, split finer.

    The step's gradients are dropped, BatchNorm running statistics go back to their values
    when the step began, the allocator's cache is freed, ``acc.splits`` doubles, and the
    step's loader batches that had already run (``acc.held``) are returned, to be run again
    before ``batch``. Call it outside the ``except`` block (whose traceback holds the failed
    step's tensors), once :func:`recoverable` said yes.
    """
    acc.drop_step()
    free_memory()
    acc.splits *= 2
    acc.recoveries += 1
    warnings.warn(
        f"out of memory: running the step's {len(acc.held) + 1} loader batch(es) again as "
        f"{acc.splits} micro-batches of <= {acc.micro_size(batch)} images each (effective batch unchanged)",
        RuntimeWarning, stacklevel=2)
    return list(acc.held)


def retry_step(acc: Accumulator, step: Callable[..., Any], optimizer: torch.optim.Optimizer, *args: Any,
               **kwargs: Any) -> Any:
    """``step(optimizer, *args, **kwargs)``, retried once after an out-of-memory error.

    On the error the allocator's cache is freed and the step runs again with the optimizer's
    multi-tensor (foreach) implementation off, which needs temporaries of one parameter at a
    time. The retry is exact when the error came before the optimizer changed a tensor (a
    foreach step allocates its temporaries first; the fused ones allocate none); when an
    Adam-style step counter shows it had already begun, the error is re-raised with that
    explanation. ``acc.step_retries`` counts the retries (several processes then continue
    as rank 0: :func:`resync`).
    """
    marker = _step_marker(optimizer)
    try:
        return step(optimizer, *args, **kwargs)
    except Exception as exc:
        if not is_oom_error(exc):
            raise
        if not _same_marker(_step_marker(optimizer), marker):
            raise RuntimeError("out of memory inside optimizer.step after it had begun to update its "
                               "state, so it cannot be retried exactly; resume from the last checkpoint "
                               "with a smaller batch") from exc
    free_memory()
    _foreach_off(optimizer)
    acc.recoveries += 1
    acc.step_retries += 1
    warnings.warn("out of memory in optimizer.step: retrying one parameter at a time (foreach off)",
                  RuntimeWarning, stacklevel=2)
    return step(optimizer, *args, **kwargs)


def resync(acc: Accumulator, optimizer: torch.optim.Optimizer) -> None:
    """Every rank continues as rank 0 after some rank retried a step (:func:`retry_step`).

    The retry runs the optimizer without its multi-tensor kernels, which need not round as
    the others do; so all ranks turn them off and take rank 0's parameters, buffers and
    optimizer state. A collective: call it on every rank once the ranks agree that a retry
    happened. A no-op in one process.
    """
    if acc.world_size == 1:
        return
    _foreach_off(optimizer)
    tensors = [*acc.model.parameters(), *acc.model.buffers()]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    nccl = dist.get_backend() == "nccl"
    with torch.no_grad():
        for t in tensors:   # host tensors (Adam's step counts) go over gloo under NCCL
            dist.broadcast(t.data, src=0, group=host_group() if nccl and t.device.type == "cpu" else None)
    acc.batchnorm.mark()    # rank 0's statistics are where the next step begins


def _foreach_off(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        if "foreach" in group:
            group["foreach"] = False


def _step_marker(optimizer: torch.optim.Optimizer) -> tuple[int, Any] | None:
    """What a step changes first in the state of the optimizer's first parameter.

    ``(number of state entries, a copy of the step counter)``: a first step creates the
    entries, and Adam-style optimizers count steps before anything else. Copied, not read:
    comparing happens only after an error.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            step = state.get("step")
            return len(state), step.clone() if isinstance(step, torch.Tensor) else step
    return None


def _same_marker(a: tuple[int, Any] | None, b: tuple[int, Any] | None) -> bool:
    if a is None or b is None:
        return a is b
    if a[0] != b[0] or type(a[1]) is not type(b[1]):
        return False
    return torch.equal(a[1], b[1]) if isinstance(a[1], torch.Tensor) else a[1] == b[1]
