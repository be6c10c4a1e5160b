"""Process-group setup, rank helpers, reductions, and PyTorch's DDP wrapper as the alternative.

Every helper works with or without an initialised process group, so the same loop runs
as one plain process, under :func:`yolokit.accel.launcher.launch`, or under ``torchrun``.
yolokit trains several processes by summing gradients itself (what the trainer does)::

    device = setup()                       # reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*
    broadcast_module(model.to(device))     # every rank starts from rank 0's weights
    acc = Accumulator(model, accumulate=2) # backward locally; acc.sync() sums the gradients
    ...                                    # (bucketed all-reduces, BatchNorm statistics combined)
    if is_main():
        torch.save(model.state_dict(), "last.pt")
    teardown()

Summing at the step rather than during the backward keeps every out-of-memory error
recoverable, needs no padding of uneven shards, and makes N processes take bit for bit the
step one process takes. PyTorch's ``DistributedDataParallel`` (:func:`wrap_ddp`, with
:func:`no_sync` while accumulating and :func:`unwrap` to save) overlaps the all-reduce with
the backward instead; it works with every other accel piece, but not with the Accumulator.

Failure handling: the launcher (``launch`` or torchrun) terminates the other ranks when
one raises or dies, and ``setup`` gives every collective a timeout, so no rank waits
forever. :class:`yolokit.accel.stop.GracefulStop` turns Ctrl-C and torchrun's SIGTERM into a
stop that every rank makes at the same optimizer step.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import warnings
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from yolokit.accel.devices import resolve_device, use_device

T = TypeVar("T")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def rank() -> int:
    """Global rank of this process (``RANK`` before setup; 0 when not distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else _env_int("RANK", 0)


def world_size() -> int:
    """Number of processes (``WORLD_SIZE`` before setup; 1 when not distributed)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return _env_int("WORLD_SIZE", 1)


def local_rank() -> int:
    """Rank of this process on its machine (``LOCAL_RANK``; 0 when not distributed)."""
    return _env_int("LOCAL_RANK", 0)


def local_world_size() -> int:
    """Processes on this machine (``LOCAL_WORLD_SIZE``, else the world size; 1 when not distributed)."""
    world = world_size()
    return _env_int("LOCAL_WORLD_SIZE", world) if world > 1 else 1


def is_main() -> bool:
    """True on global rank 0, the process that logs and saves."""
    return rank() == 0


def is_initialized() -> bool:
    """Whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def setup(
    backend: str | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    timeout: float | datetime.timedelta = 1800.0,
    device: str | torch.device | None = None,
) -> torch.device:
    """Initialise the default process group and pick this rank's device.

    Arguments left ``None`` are read from torchrun's environment (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). With a world size
    of 1 no group is created and the helpers in this module act as no-ops.

    Args:
        backend: ``"nccl"`` or ``"gloo"``; ``None`` picks nccl when CUDA is available,
            else gloo.
        rank: Global rank.
        world_size: Number of processes.
        local_rank: Rank on this machine; selects the CUDA device (with ``LOCAL_WORLD_SIZE``).
        master_addr: Address of rank 0 (default ``127.0.0.1``).
        master_port: Port of rank 0 (default ``29500``).
        timeout: Seconds (or a timedelta) any collective may wait before failing.
        device: ``"auto"`` / None (CUDA when available), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``:
            local rank r trains on ``cuda:r`` (``cuda:N+r``); see
            :func:`yolokit.accel.devices.resolve_device`, which validates it. It is made the
            current device in one process too.

    Returns:
        This process's device.
    """
    rank_ = _env_int("RANK", 0) if rank is None else rank
    world = _env_int("WORLD_SIZE", 1) if world_size is None else world_size
    local = _env_int("LOCAL_RANK", rank_) if local_rank is None else local_rank
    local_world = _env_int("LOCAL_WORLD_SIZE", world) if world > 1 else 1   # before the group: from the arguments
    device = use_device(resolve_device(device, local_rank=local if world > 1 else 0, local_world=local_world))
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if world == 1 or is_initialized():
        return device
    os.environ.update(RANK=str(rank_), WORLD_SIZE=str(world), LOCAL_RANK=str(local))  # for rank helpers
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=timeout)
    if master_addr is None and master_port is None and {"MASTER_ADDR", "MASTER_PORT"} <= set(os.environ):
        init_method = "env://"  # torchrun's own path (reuses its agent's store)
    else:
        addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
        init_method = f"tcp://{addr}:{master_port or _env_int('MASTER_PORT', 29500)}"
    store, rank_, world = next(dist.rendezvous(init_method, rank_, world, timeout=timeout))
    # A group torchrun restarts reaches the same store, which still holds the dead group's
    # entries (gloo's peer addresses): a fresh prefix per attempt keeps them apart. Without
    # it the new ranks could dial the dead ones and fail or hang in init_process_group.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"yolokit/attempt{attempt}", store),
        rank=rank_,
        world_size=world,
        timeout=timeout,
        device_id=device if backend == "nccl" else None,
    )
    return device


_HOST_GROUPS: dict[int, Any] = {}   # id(default group) -> its gloo twin (NCCL runs only)


def host_group() -> Any:
    """A gloo group of all ranks, for small agreements on the host (no accelerator sync).

    The default group itself when it is gloo; under NCCL a gloo group made on first use
    (a collective: every rank calls this at the same point the first time) and kept until
    :func:`teardown`. None when not distributed.
    """
    if not is_initialized():
        return None
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    key = id(dist.group.WORLD)
    if key not in _HOST_GROUPS:
        _HOST_GROUPS[key] = dist.new_group(backend="gloo")
    return _HOST_GROUPS[key]


def all_ranks_agree(ok: bool) -> bool:
    """True when ``ok`` is true on every rank (a tiny all-reduce over :func:`host_group`).

    Every rank must call it at the same point. Use it before a collective that one rank
    might not be able to start (an allocation that failed), so that all take the same path.
    """
    if not is_initialized() or dist.get_world_size() == 1:
        return ok
    flag = torch.tensor([int(ok)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=host_group())
    return bool(flag.item())


def teardown() -> None:
    """Destroy the default process group if one exists (safe to call twice).

    Unreachable DDP wrappers are collected first: a ``DistributedDataParallel`` that outlives
    its process group can abort the process at exit ("terminate called without an active
    exception", SIGABRT). Delete DDP-wrapped models you still hold before calling it.
    """
    if is_initialized():
        gc.collect()
        _HOST_GROUPS.clear()
        dist.destroy_process_group()


def convert_sync_batchnorm(model: nn.Module, device: torch.device | str | None = None) -> nn.Module:
    """``model`` with its BatchNorm layers as SyncBatchNorm (batch statistics over all ranks), in place.

    CUDA only: on another device a warning is issued and BatchNorm is kept. SyncBatchNorm
    runs collectives in every forward and backward, so every rank must run the same number
    of micro-batches.
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if device.type != "cuda":
        warnings.warn("SyncBatchNorm needs CUDA devices; keeping per-process BatchNorm", RuntimeWarning, stacklevel=2)
        return model
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def wrap_ddp(
    model: nn.Module,
    *,
    sync_bn: bool = False,
    device: torch.device | str | None = None,
    find_unused_parameters: bool = False,
    **ddp_kwargs: Any,
) -> nn.Module:
    """Wrap ``model`` in DistributedDataParallel; a no-op without a process group.

    PyTorch's own way of training on several processes: DDP all-reduces the gradients
    during the backward (averaged over the ranks). Accumulate with :func:`no_sync` on every
    backward but a step's last. yolokit's trainer sums gradients with
    :class:`yolokit.accel.Accumulator` instead (see :mod:`yolokit.accel.accumulation`).

    Args:
        model: Model already on this rank's device.
        sync_bn: Convert BatchNorm layers to SyncBatchNorm first (:func:`convert_sync_batchnorm`).
        device: This rank's device; defaults to the device of the model's parameters.
        find_unused_parameters: Passed to DDP.
        **ddp_kwargs: Other DDP arguments (``static_graph``, ``bucket_cap_mb``, ...).

    Returns:
        The DDP-wrapped model, or ``model`` itself when ``world_size() == 1``.
    """
    if not is_initialized() or dist.get_world_size() == 1:
        return model
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if sync_bn:
        model = convert_sync_batchnorm(model, device)
    device_ids = [device] if device.type == "cuda" else None
    return DistributedDataParallel(
        model, device_ids=device_ids, find_unused_parameters=find_unused_parameters, **ddp_kwargs
    )


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside DDP and/or ``torch.compile`` wrappers (for saving, EMA)."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile
            model = model._orig_mod
        else:
            return model


def no_sync(model: nn.Module, enabled: bool = True) -> contextlib.AbstractContextManager:
    """Skip DDP's gradient all-reduce inside the context (accumulation micro-steps).

    Args:
        model: Possibly DDP-wrapped model.
        enabled: When False (the last micro-step) gradients are synchronised as usual.

    Returns:
        ``model.no_sync()`` for an enabled DDP model (also under ``torch.compile``), else a null context.
    """
    inner = getattr(model, "_orig_mod", model)   # torch.compile around DDP, or the model itself
    if enabled and isinstance(inner, DistributedDataParallel):
        return inner.no_sync()
    return contextlib.nullcontext()


def barrier() -> None:
    """Wait for all ranks; a no-op when not distributed."""
    if is_initialized():
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_mean(x: torch.Tensor | float) -> torch.Tensor | float:
    """Mean of ``x`` over ranks; returns ``x`` unchanged when not distributed.

    Args:
        x: Tensor of any shape (same shape on every rank) or a Python number.

    Returns:
        A new tensor of the same shape and device (float64 for integer tensors), or a
        float for a number.
    """
    if not is_initialized():
        return x
    if isinstance(x, torch.Tensor):
        dtype = x.dtype if x.is_floating_point() else torch.float64
        y = x.detach().to(_collective_device(), dtype=dtype, copy=True)
        dist.all_reduce(y, op=dist.ReduceOp.SUM)
        return (y / dist.get_world_size()).to(x.device)
    y = torch.tensor(float(x), dtype=torch.float64, device=_collective_device())
    dist.all_reduce(y, op=dist.ReduceOp.SUM)
    return float(y) / dist.get_world_size()


def broadcast_object(obj: T, src: int = 0) -> T:
    """Send a picklable object from rank ``src`` to all ranks (e.g. a run directory name)."""
    if not is_initialized():
        return obj
    box = [obj]
    device = _collective_device() if dist.get_backend() == "nccl" else None
    dist.broadcast_object_list(box, src=src, device=device)
    return box[0]


def all_gather_object(obj: T) -> list[T]:
    """Every rank's ``obj`` (picklable), in rank order; ``[obj]`` when not distributed."""
    if not is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


@torch.no_grad()
def broadcast_module(model: nn.Module, src: int = 0) -> nn.Module:
    """Copy rank ``src``'s parameters and buffers into every rank's ``model`` (in place).

    What DDP does when it wraps a model; call it once after building the model when the
    processes sum their gradients themselves (:class:`yolokit.accel.accumulation.Accumulator`).
    A no-op when not distributed.
    """
    if is_initialized() and dist.get_world_size() > 1:
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=src)
    return model
