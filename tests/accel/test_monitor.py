"""monitor: valid empty readings on CPU; NVML parsed when present and ignored when absent."""

import sys
import time
import types

import pytest
import torch

from yolokit.accel import monitor
from yolokit.accel.monitor import DeviceMonitor, DeviceStats, read_device_stats


@pytest.fixture
def fresh_nvml(monkeypatch):
    monkeypatch.setattr(monitor, "_NVML", {})


def test_cpu_reading_is_valid_and_empty():
    stats = read_device_stats("cpu")
    assert stats == DeviceStats(device="cpu")
    assert stats.as_dict() == {"device": "cpu"} and stats.summary() == "cpu"


def test_summary_and_as_dict_of_a_full_reading():
    gib = 2**30
    stats = DeviceStats("cuda:0", gib, 2 * gib, 3 * gib, 80 * gib, 97.0, 40.0, 64.0, 250.0)
    assert stats.summary() == "cuda:0 mem 1.00/2.00 GiB (peak 3.00) util 97% 64C 250W"
    assert stats.as_dict()["power_w"] == 250.0 and len(stats.as_dict()) == 9


def test_monitor_thread_samples_and_summarises(fresh_nvml):
    with DeviceMonitor("cpu", interval=0.01) as mon:
        time.sleep(0.1)
    assert len(mon.samples) >= 2 and all(s.device == "cpu" for s in mon.samples)
    assert mon.summary() == {}
    n = len(mon.samples)
    time.sleep(0.05)
    assert len(mon.samples) == n  # stopped
    mon.samples = [
        DeviceStats("cuda:0", 1, 10, 5, 100, 50.0, None, 60.0, 100.0),
        DeviceStats("cuda:0", 2, 20, 7, 100, 70.0, None, 62.0, 200.0),
    ]
    assert mon.summary() == {
        "peak_allocated_bytes": 7,
        "peak_reserved_bytes": 20,
        "mean_utilization_percent": 60.0,
        "mean_temperature_c": 61.0,
        "mean_power_w": 150.0,
    }


def test_without_pynvml(fresh_nvml, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    assert monitor._pynvml() is None and monitor._nvml_readings(0) == {}


def _fake_pynvml(fail_temperature: bool = False) -> types.ModuleType:
    fake = types.ModuleType("pynvml")
    fake.NVML_TEMPERATURE_GPU = 0
    fake.nvmlInit = lambda: None
    fake.nvmlDeviceGetHandleByPciBusId = lambda bus: (_ for _ in ()).throw(RuntimeError("no bus"))
    fake.nvmlDeviceGetHandleByIndex = lambda i: f"handle{i}"
    fake.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=93, memory=41)

    def temperature(handle, sensor):
        if fail_temperature:
            raise RuntimeError("not supported")
        return 71

    fake.nvmlDeviceGetTemperature = temperature
    fake.nvmlDeviceGetPowerUsage = lambda h: 215500  # milliwatts
    return fake


def test_nvml_readings_are_parsed(fresh_nvml, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    assert monitor._nvml_readings(1) == {
        "utilization_percent": 93.0,
        "memory_utilization_percent": 41.0,
        "temperature_c": 71.0,
        "power_w": 215.5,
    }


def test_nvml_partial_readings_are_kept(fresh_nvml, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(fail_temperature=True))
    assert monitor._nvml_readings(0) == {"utilization_percent": 93.0, "memory_utilization_percent": 41.0}


@pytest.mark.gpu
def test_cuda_memory_readings():
    torch.cuda.reset_peak_memory_stats()
    x = torch.empty(64, 2**20, device="cuda")  # 256 MiB
    stats = read_device_stats()
    assert stats.device.startswith("cuda:")
    assert stats.allocated_bytes >= x.numel() * 4 and stats.reserved_bytes >= stats.allocated_bytes
    assert stats.peak_allocated_bytes >= stats.allocated_bytes and stats.total_bytes > stats.reserved_bytes
    del x
