"""Alternating timer, peak-memory readings, and a description of the machine.

``alternate`` times two (or more) callables in turns, A B A B ..., so that load from
other processes on a shared machine hits every side alike; results are medians.
``peak_memory`` reads the extra memory one call needs: CUDA's allocator peak on a GPU,
the process's peak resident set on CPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# glibc mallopt parameters. While a peak is read, blocks of 64 KiB and more are mapped
# and unmapped on their own, so freed memory goes back to the system and the peak of the
# call starts from a clean base; afterwards the thresholds are set to the values glibc's
# own adjustment reaches in a process that frees large blocks (32 / 64 MiB).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


@dataclass(frozen=True)
class Timed:
    """What a timed callable may return when it times itself (e.g. after its own warm-up).

    Attributes:
        seconds: time of the counted part.
        units: what was done in it (images, calls); the result is seconds per unit.
    """

    seconds: float
    units: int


def alternate(fns: Sequence[Callable[[], Any]], *, warmup: int, repeats: int, inner: int = 1) -> list[list[float]]:
    """Seconds per unit of each callable, measured in turns.

    Each round runs every callable once (``inner`` calls counted as one run), in the
    order given: A B A B ... . A callable returning ``Timed`` reports its own time and
    units; anything else counts as one unit timed from outside.

    Args:
        fns: the callables (yolokit first, then the reference).
        warmup: uncounted rounds first.
        repeats: counted rounds.
        inner: calls per counted run (for calls too short to time one by one).

    Returns:
        Per callable, the ``repeats`` measured seconds per unit, in run order.
    """
    for _ in range(warmup):
        for fn in fns:
            fn()
    runs: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for k, fn in enumerate(fns):
            seconds, units = 0.0, 0
            for _ in range(inner):
                start = time.perf_counter()
                out = fn()
                elapsed = time.perf_counter() - start
                if isinstance(out, Timed):
                    seconds, units = seconds + out.seconds, units + out.units
                else:
                    seconds, units = seconds + elapsed, units + 1
            runs[k].append(seconds / max(units, 1))
    return runs


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def _can_reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _status_bytes("VmHWM")
        return True
    except (OSError, KeyError):
        return False


def peak_memory(fn: Callable[[], Any], device: torch.device | str = "cpu") -> int | None:
    """Extra memory, in bytes, that one call of ``fn`` needs at its peak.

    CUDA: ``torch.cuda.max_memory_allocated`` over the call minus what was allocated
    before it. CPU (Linux): the peak resident set (``VmHWM``, reset through
    ``/proc/self/clear_refs``) minus the resident set before the call, with glibc set to
    return freed blocks of 64 KiB and more to the system during the call (glibc's
    thresholds stay fixed afterwards, so call it after the timings). ``None`` where it
    cannot be read.
    """
    device = torch.device(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - before)
    if not sys.platform.startswith("linux") or not _can_reset_peak_rss():
        return None
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
        libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_bytes("VmRSS")
    try:
        fn()
        return max(0, _status_bytes("VmHWM") - before)
    finally:
        if libc is not None:
            libc.mallopt(_M_MMAP_THRESHOLD, 32 * 2**20)
            libc.mallopt(_M_TRIM_THRESHOLD, 64 * 2**20)


def cpu_name() -> str:
    """The CPU model (from /proc/cpuinfo on Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def machine() -> str:
    """One line: CPU, cores, memory, OS, torch threads, load average; the GPU when there is one."""
    try:
        mem = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM"
    except (ValueError, OSError, AttributeError):
        mem = ""
    load = ""
    if hasattr(os, "getloadavg"):
        load = "; load average " + " ".join(f"{v:.2f}" for v in os.getloadavg())
    gpu = ""
    if torch.cuda.is_available():
        gpu = f"; GPU {torch.cuda.get_device_name()}"
    return (f"{cpu_name()}, {os.cpu_count()} logical CPUs{mem}, {platform.system()} {platform.release()}; "
            f"torch threads {torch.get_num_threads()}{load}{gpu}")


def versions(extra: dict[str, str] | None = None) -> str:
    """Python, torch, torchvision, numpy, OpenCV and yolokit versions (plus ``extra``)."""
    import cv2
    import numpy as np
    import torchvision

    import yolokit

    parts = {"python": platform.python_version(), "torch": torch.__version__, "torchvision": torchvision.__version__,
             "numpy": np.__version__, "opencv": cv2.__version__, "yolokit": yolokit.__version__, **(extra or {})}
    return ", ".join(f"{k} {v}" for k, v in parts.items())


def command() -> str:
    """The command line of this process."""
    return shlex.join([sys.executable, *sys.argv])
