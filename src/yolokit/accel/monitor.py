"""Device readings: memory allocated / reserved / peak, and NVML utilisation when present.

Memory numbers come from PyTorch's CUDA allocator. Utilisation, temperature and power
come from NVML through ``torch.cuda.utilization`` and its siblings, which need the optional
``nvidia-ml-py`` package (amdsmi on ROCm) and raise without it. Any quantity that cannot be
read is ``None``, so a reading on CPU is valid and empty::

    read_device_stats("cpu").as_dict()        # {'device': 'cpu'}
    with DeviceMonitor("cuda", interval=1.0) as mon:
        train_one_epoch()
    print(mon.summary())                       # peak memory, mean utilisation
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any

import torch

# DeviceStats field -> (torch.cuda reader, divisor to our unit). torch maps the CUDA index to
# NVML's through CUDA_VISIBLE_DEVICES (ordinals or GPU- UUIDs; MIG- reads nothing), taking CUDA's
# order to be NVML's PCI bus order: on mixed-GPU machines set CUDA_DEVICE_ORDER=PCI_BUS_ID.
_NVML_READERS: dict[str, tuple[str, float]] = {
    "utilization_percent": ("utilization", 1.0),
    "memory_utilization_percent": ("memory_usage", 1.0),
    "temperature_c": ("temperature", 1.0),
    "power_w": ("power_draw", 1000.0),  # milliwatts
}


@dataclass(frozen=True)
class DeviceStats:
    """One reading; ``None`` marks a quantity this device or setup cannot report."""

    device: str
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    total_bytes: int | None = None
    utilization_percent: float | None = None
    memory_utilization_percent: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    temperature_limit_c: float | None = None   # where the GPU slows its clocks down (a reader that knows it)
    power_limit_w: float | None = None         # the power cap it enforces (likewise)

    def as_dict(self) -> dict[str, Any]:
        """The available fields only (for loggers)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def summary(self) -> str:
        """One short line, e.g. ``cuda:0 mem 3.2/4.0 GiB (peak 5.1) util 97% 64C 250W``."""
        gib = 2.0**30
        parts = [self.device]
        if self.allocated_bytes is not None:
            parts.append(f"mem {self.allocated_bytes / gib:.2f}/{(self.reserved_bytes or 0) / gib:.2f} GiB")
        if self.peak_allocated_bytes is not None:
            parts.append(f"(peak {self.peak_allocated_bytes / gib:.2f})")
        if self.utilization_percent is not None:
            parts.append(f"util {self.utilization_percent:.0f}%")
        if self.temperature_c is not None:
            parts.append(f"{self.temperature_c:.0f}C")
        if self.power_w is not None:
            parts.append(f"{self.power_w:.0f}W")
        return " ".join(parts)


def _nvml_readings(index: int) -> dict[str, float]:
    """NVML readings of CUDA device ``index``; a reading that raises is left out.

    Without ``nvidia-ml-py``, a driver or NVML support for a quantity, torch raises
    (``ModuleNotFoundError``, ``RuntimeError``, ``pynvml.NVMLError``): all mean "no reading".
    """
    out: dict[str, float] = {}
    for key, (reader, divisor) in _NVML_READERS.items():
        try:
            out[key] = float(getattr(torch.cuda, reader)(index)) / divisor
        except Exception:
            continue
    return out


def resident_bytes() -> int | None:
    """This process's resident memory now, in bytes (``/proc/self/statm``; the peak where only
    ``getrusage`` is available, as on macOS); ``None`` where neither can be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:   # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def memory_in_use(device: torch.device | str) -> int:
    """Bytes the training process holds on ``device``: the CUDA allocator's reserved memory, else
    the process's resident memory (0 when unreadable)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device)
    return resident_bytes() or 0


def read_device_stats(device: torch.device | str | None = None) -> DeviceStats:
    """Read memory and, through NVML when present, utilisation, temperature and power.

    Args:
        device: Device to read; ``None`` means the current CUDA device when available.

    Returns:
        A :class:`DeviceStats`; only ``device`` is set for CPU (or without CUDA).
    """
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return DeviceStats(device=str(device))
    index = device.index if device.index is not None else torch.cuda.current_device()
    return DeviceStats(
        device=f"cuda:{index}",
        allocated_bytes=torch.cuda.memory_allocated(index),
        reserved_bytes=torch.cuda.memory_reserved(index),
        peak_allocated_bytes=torch.cuda.max_memory_allocated(index),
        total_bytes=torch.cuda.get_device_properties(index).total_memory,
        **_nvml_readings(index),
    )


class DeviceMonitor:
    """Collect :class:`DeviceStats` by hand (:meth:`sample`) or from a background thread.

    Args:
        device: Device to watch (see :func:`read_device_stats`).
        interval: Seconds between readings of the background thread.
        reader: ``reader(device)`` -> :class:`DeviceStats`; default :func:`read_device_stats`.
    """

    def __init__(self, device: torch.device | str | None = None, *, interval: float = 1.0,
                 reader: Any = None) -> None:
        self.device = device
        self.interval = interval
        self.reader = reader or read_device_stats
        self.samples: list[DeviceStats] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> DeviceStats:
        """Take one reading and keep it."""
        stats = self.reader(self.device)
        self.samples.append(stats)
        return stats

    def start(self) -> DeviceMonitor:
        """Start sampling every ``interval`` seconds in a daemon thread."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="yolokit-device-monitor", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread after one last reading."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        self.sample()
        while not self._stop.wait(self.interval):
            self.sample()
        self.sample()

    def __enter__(self) -> DeviceMonitor:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def summary(self) -> dict[str, float]:
        """Peaks and means over the samples taken (empty on CPU).

        Returns:
            ``peak_allocated_bytes`` and ``peak_reserved_bytes`` (max), the mean of
            ``utilization_percent``, ``temperature_c`` and ``power_w``, the highest temperature,
            and the device's temperature and power limits, where read.
        """
        out: dict[str, float] = {}
        for key, name, reduce in (
            ("peak_allocated_bytes", "peak_allocated_bytes", max),
            ("reserved_bytes", "peak_reserved_bytes", max),
            ("utilization_percent", "mean_utilization_percent", _mean),
            ("temperature_c", "mean_temperature_c", _mean),
            ("temperature_c", "max_temperature_c", max),
            ("power_w", "mean_power_w", _mean),
            ("temperature_limit_c", "temperature_limit_c", min),
            ("power_limit_w", "power_limit_w", min),
        ):
            values = [getattr(s, key) for s in self.samples if getattr(s, key) is not None]
            if values:
                out[name] = reduce(values)
        return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
