"""The one place a device name becomes a ``torch.device``: parsed, validated, and made current.

Every entry point resolves its device here: the CLI's ``--device``, the trainer (through
:func:`yolokit.accel.distributed.setup`), :class:`yolokit.accel.amp.Precision`. Names are
``auto`` (CUDA when available, else the CPU), ``cpu``, ``cuda`` and ``cuda:N``.

Several processes on one machine take consecutive devices: under ``cuda`` (or ``auto`` on a
CUDA machine) local rank r trains on ``cuda:r``; under ``cuda:N`` on ``cuda:N+r``, so
``--device cuda:1 --devices 2`` uses GPUs 1 and 2. Two processes never share a GPU
(NCCL refuses it); asking for more devices than there are is an error that names them.
"""

from __future__ import annotations

import re

import torch

_NAMES = "use auto, cpu, cuda or cuda:N"


def resolve_device(name: str | torch.device | None = "auto", *, local_rank: int = 0,
                   local_world: int = 1) -> torch.device:
    """The device of process ``local_rank`` of ``local_world`` on this machine.

    Args:
        name: ``"auto"`` (or None), ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device``.
        local_rank: This process's rank on its machine.
        local_world: Processes on this machine.

    Returns:
        ``cpu``, or ``cuda:<index>`` with the index worked out as the module says.

    Raises:
        ValueError: an unknown name, CUDA asked for where there is none, or a device index
            (with the processes' consecutive ones) beyond the devices there are.

    Examples:
        >>> resolve_device("cpu")
        device(type='cpu')
        >>> resolve_device("gpu")
        Traceback (most recent call last):
        ...
        ValueError: unknown device 'gpu'; use auto, cpu, cuda or cuda:N
    """
    if not 0 <= local_rank < max(local_world, 1):
        raise ValueError(f"local_rank {local_rank} is not in [0, {local_world})")
    if name is None or name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {name!r}; {_NAMES}") from exc
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(f"unknown device {str(name)!r}; {_NAMES}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {str(name)!r} asked for, but CUDA is not available here")
    first, count = device.index or 0, torch.cuda.device_count()
    if first + local_world > count:
        wanted = f"cuda:{first}" if local_world == 1 else f"cuda:{first}..cuda:{first + local_world - 1}"
        raise ValueError(f"device {str(name)!r} with {local_world} process(es) on this machine needs {wanted}, "
                         f"but there are {count} CUDA devices")
    return torch.device("cuda", first + local_rank)


def use_device(device: torch.device) -> torch.device:
    """Makes ``device`` this process's current CUDA device (a no-op for the CPU); returns it.

    Without it, kernels and NCCL of a process training on ``cuda:N`` would start on ``cuda:0``.
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


class DeviceFailure(RuntimeError):
    """The device failed during a run (a CUDA error, not out of memory): the message says where, with
    which files, and how to find the kernel; the CUDA error is its ``__cause__``."""


# a failed kernel or library call: the process's CUDA context is unusable from here on
_DEVICE_ERROR = re.compile(r"CUDA error|cudaError|CUDA_ERROR|device-side assert|illegal memory access"
                           r"|CUBLAS_STATUS|CUDNN_STATUS|NCCL error|unspecified launch failure")
_OUT_OF_MEMORY = re.compile(r"out of memory|ALLOC_FAILED|NOT_ENOUGH_WORKSPACE|cudaErrorMemoryAllocation")


def is_device_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the device failing (``torch.AcceleratorError``, or a library's report of a failed
    CUDA call), as opposed to out of memory, which a run may survive (:mod:`yolokit.accel.oom`).

    Examples:
        >>> is_device_error(RuntimeError("CUDA error: device-side assert triggered"))
        True
        >>> is_device_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
        False
    """
    if isinstance(exc, torch.OutOfMemoryError) or not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    if _OUT_OF_MEMORY.search(text):
        return False
    return isinstance(exc, torch.AcceleratorError) or _DEVICE_ERROR.search(text) is not None
