"""Is the GPU fed? The device's readings over each epoch, next to ``data%``, and what to change.

:class:`EpochMonitor` samples the training device from a background thread
(:class:`yolokit.accel.DeviceMonitor`, NVML through ``torch.cuda``; the slowdown temperature
and the power limit through ``pynvml``, the ``gpu`` extra) while an epoch trains, and gives
the results row its columns: ``gpu_busy%`` (the share of the time a kernel ran), the peak
memory, the highest temperature and the mean power. One warning per run names the likely
cause and the knob: a busy share under half while the loop waited for data (the loader: more
workers, the device augmentation path, the image cache), or a temperature or power near its
limit (throttled clocks).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from yolokit.accel.monitor import DeviceMonitor, DeviceStats, read_device_stats

STARVED_BUSY, STARVED_DATA = 50.0, 0.2     # under half busy, while the loop waited for data a fifth of the time
HOT_MARGIN_C, POWER_SHARE = 5.0, 0.95      # within 5 C of the slowdown temperature, or 95% of the power limit


def nvml_limits(device: torch.device) -> dict[str, float]:
    """The slowdown temperature and the enforced power limit of a CUDA device (empty where unknown)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
    except Exception:   # no gpu extra, no driver: nothing to compare with
        return {}
    out: dict[str, float] = {}
    for key, read in (("temperature_limit_c", lambda: pynvml.nvmlDeviceGetTemperatureThreshold(
            handle, pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)),
                      ("power_limit_w", lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0)):
        try:
            out[key] = float(read())
        except Exception:
            continue
    return out


class DataWait:
    """How long the training loop waited for its loader this epoch: host time between asking for a batch
    and getting it, with no device sync. ``share()`` is ``data%`` of the results row."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self.started = self.asked = time.perf_counter()
        self.waited = 0.0

    def got_batch(self) -> None:
        self.waited += time.perf_counter() - self.asked

    def ask(self) -> None:
        self.asked = time.perf_counter()

    def seconds(self) -> float:
        """Since the epoch started."""
        return time.perf_counter() - self.started

    def share(self) -> float:
        """Share of this epoch's training time so far spent waiting for data, in [0, 1]."""
        return self.waited / max(self.seconds(), 1e-9)


class EpochMonitor:
    """The training device watched over each epoch (see the module).

    Args:
        device: The training device.
        interval: Seconds between readings.
        reader: ``reader(device)`` -> :class:`DeviceStats` (tests give a fake one); default NVML's
            readings with the device's limits.
    """

    def __init__(self, device: torch.device, *, interval: float = 1.0,
                 reader: Callable[[Any], DeviceStats] | None = None) -> None:
        self.device, self.interval = device, interval
        if reader is None:
            limits = nvml_limits(device) if device.type == "cuda" else {}

            def reader(dev: Any) -> DeviceStats:
                return dataclasses.replace(read_device_stats(dev), **limits)
        self.reader = reader
        self.warned: set[str] = set()
        self._monitor: DeviceMonitor | None = None

    def start(self) -> None:
        """Start sampling (the peak memory counts from here)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._monitor = DeviceMonitor(self.device, interval=self.interval, reader=self.reader).start()

    def stop(self, epoch: int, data_share: float, knobs: str) -> dict[str, float]:
        """Stop sampling; the epoch's columns for the results row, after warning (once per kind and run)
        when the GPU starved (``knobs``: what the run sets now, named in the warning) or ran hot."""
        if self._monitor is None:
            return {}
        self._monitor.stop()
        summary, self._monitor = self._monitor.summary(), None
        row = {key: round(summary[name] / scale, 2) for key, name, scale in (
            ("gpu_busy%", "mean_utilization_percent", 1.0), ("gpu_mem_peak_gb", "peak_allocated_bytes", 2**30),
            ("gpu_temp_c", "max_temperature_c", 1.0), ("gpu_power_w", "mean_power_w", 1.0)) if name in summary}
        busy = summary.get("mean_utilization_percent")
        if busy is not None and busy < STARVED_BUSY and data_share >= STARVED_DATA:
            self._warn("starved", f"the GPU was busy {busy:.0f}% of epoch {epoch + 1} while the training loop "
                                  f"waited for data {100 * data_share:.0f}% of its time: the loader does not keep up. "
                                  f"Give it more workers (--workers), move the augmentation to the GPU "
                                  f"(--augment-on device) or keep decoded images (--cache ram); now {knobs}")
        hot = []
        temperature, slowdown = summary.get("mean_temperature_c"), summary.get("temperature_limit_c")
        if temperature is not None and slowdown is not None and temperature >= slowdown - HOT_MARGIN_C:
            hot.append(f"{temperature:.0f} C of its {slowdown:.0f} C slowdown temperature")
        power, cap = summary.get("mean_power_w"), summary.get("power_limit_w")
        if power is not None and cap is not None and power >= POWER_SHARE * cap:
            hot.append(f"{power:.0f} W of its {cap:.0f} W power limit")
        if hot:
            self._warn("throttled", f"the GPU ran at {' and '.join(hot)} over epoch {epoch + 1}: its clocks are "
                                    "likely throttled (check its cooling and power cap)")
        return row

    def close(self) -> None:
        """Stop sampling without a row (a run that ended mid-epoch)."""
        if self._monitor is not None:
            self._monitor.stop()
            self._monitor = None

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self.warned:
            self.warned.add(kind)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
