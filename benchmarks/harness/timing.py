"""The one set of timers and memory readers every benchmark script uses.

``alternate`` times two (or more) callables in turns, A B A B ..., so that load from
other processes on a shared machine hits every side alike; results are medians. On a
GPU it synchronizes around each counted run, so the time is the device's.
``peak_memory`` reads the memory one call needs at its peak: CUDA's allocator peak on a
GPU, the process's peak resident set on CPU. ``resident_bytes`` reads the resident set
(or its peak), ``cpu_seconds`` the CPU time of this process and its children, and
``header`` the command, machine and versions every script prints first, and ``allocations``
the bytes one call allocates through torch's CPU allocator, in all and at its peak.
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
        cpu_seconds: CPU time spent in it, where measured (data loaders: workers included).
    """

    seconds: float
    units: int
    cpu_seconds: float | None = None


def synchronize(device: torch.device | str | None) -> None:
    """Waits for the work queued on a CUDA ``device``; nothing for the CPU or None."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def alternate(fns: Sequence[Callable[[], Any]], *, warmup: int, repeats: int, inner: int = 1,
              device: torch.device | str | None = None) -> list[list[float]]:
    """Seconds per unit of each callable, measured in turns.

    Each round runs every callable once (``inner`` calls counted as one run), in the
    order given: A B A B ... . A counted run is timed as one block, with ``device``
    synchronized before and after it (not between its calls, so queued GPU work overlaps
    as in a training loop). A callable returning ``Timed`` reports its own time and
    units instead; anything else counts as one unit per call.

    Args:
        fns: the callables (yolokit first, then the reference).
        warmup: uncounted rounds first.
        repeats: counted rounds.
        inner: calls per counted run (for calls too short to time one by one).
        device: the device the callables queue work on (CUDA: synchronized around each run).

    Returns:
        Per callable, the ``repeats`` measured seconds per unit, in run order.
    """
    for _ in range(warmup):
        for fn in fns:
            fn()
    runs: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for k, fn in enumerate(fns):
            synchronize(device)
            start = time.perf_counter()
            outs = [fn() for _ in range(inner)]
            synchronize(device)
            elapsed = time.perf_counter() - start
            timed = [out for out in outs if isinstance(out, Timed)]
            if timed:
                seconds, units = sum(t.seconds for t in timed), sum(t.units for t in timed)
            else:
                seconds, units = elapsed, inner
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


def resident_bytes(*, peak: bool = False) -> int | None:
    """This process's resident set now (``VmRSS``), or its peak so far (``VmHWM``), in bytes.

    The peak counts from the process's start, or from the last reset by ``peak_memory``.
    ``None`` where ``/proc/self/status`` cannot be read (not Linux).
    """
    try:
        return _status_bytes("VmHWM" if peak else "VmRSS")
    except (OSError, KeyError):
        return None


def cpu_seconds(children: list[int] | None = None) -> float:
    """User + system CPU time of this process and its live children (e.g. loader workers), Linux only.

    ``children``: only these child processes (the workers of the loader being timed: another
    loader's persistent workers still prefetch in the background, and their time is not its).
    """
    tick = os.sysconf("SC_CLK_TCK")
    pids = ["self"]
    if children is not None:
        pids += [str(pid) for pid in children]
    for task in os.listdir("/proc/self/task") if children is None else ():
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids += f.read().split()
        except OSError:
            pass
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


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


def peak_memory(fn: Callable[[], Any], device: torch.device | str = "cpu", *, extra: bool = True) -> int | None:
    """Memory, in bytes, that one call of ``fn`` needs at its peak.

    CUDA: ``torch.cuda.max_memory_allocated`` over the call, minus what was allocated
    before it when ``extra``. CPU (Linux): the peak resident set (``VmHWM``, reset through
    ``/proc/self/clear_refs``), minus the resident set before the call when ``extra``,
    with glibc set to return freed blocks of 64 KiB and more to the system during the
    call (glibc's thresholds stay fixed afterwards, so call it after the timings).
    ``None`` where it cannot be read.

    Args:
        fn: one call (it may run several steps).
        device: where ``fn`` allocates.
        extra: the rise over what was held before the call; False: the whole peak
            (what was held before included: the model, its optimizer state).
    """
    device = torch.device(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device) if extra else 0
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
    before = _status_bytes("VmRSS") if extra else 0
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


def header(extra: dict[str, str] | None = None) -> str:
    """The three lines every benchmark prints first: command, machine, versions (plus ``extra``)."""
    return f"command: {command()}\nmachine: {machine()}\nversions: {versions(extra)}"


def allocations(fn: Callable[[], Any]) -> tuple[Any, int, int]:
    """What one call of ``fn`` allocates through torch's CPU allocator: (its result, the bytes
    allocated in all, the most held at once over what was held before).

    From the allocator's own records (the profiler's ``[memory]`` events, one per allocation and
    free), not the ops' memory columns: an op's column also holds what the ops inside it allocated,
    and a compiled graph's buffers have no op of their own, so summing the columns counts some bytes
    several times and misses others."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    records = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                     key=lambda e: e.start_ns())
    held = peak = total = 0
    for e in records:
        held += e.nbytes()
        peak, total = max(peak, held), total + max(0, e.nbytes())
    return result, total, peak
