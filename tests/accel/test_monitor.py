"""monitor: valid empty readings on CPU; torch.cuda's NVML readings converted when present, left out when absent."""

import importlib.util
import time
import types

import pytest
import torch

from yolokit.accel import monitor
from yolokit.accel.monitor import DeviceMonitor, DeviceStats, read_device_stats


def test_cpu_reading_is_valid_and_empty():
    stats = read_device_stats("cpu")
    assert stats == DeviceStats(device="cpu")
    assert stats.as_dict() == {"device": "cpu"} and stats.summary() == "cpu"


def test_summary_and_as_dict_of_a_full_reading():
    gib = 2**30
    stats = DeviceStats("cuda:0", gib, 2 * gib, 3 * gib, 80 * gib, 97.0, 40.0, 64.0, 250.0)
    assert stats.summary() == "cuda:0 mem 1.00/2.00 GiB (peak 3.00) util 97% 64C 250W"
    assert stats.as_dict()["power_w"] == 250.0 and len(stats.as_dict()) == 9


def test_monitor_thread_samples_and_summarises():
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
        "max_temperature_c": 62.0,
        "mean_power_w": 150.0,
    }


_READINGS = {"utilization": 93, "memory_usage": 41, "temperature": 71, "power_draw": 215500}  # power in mW


@pytest.fixture
def fake_nvml(monkeypatch):
    """torch.cuda's NVML readers replaced by fakes; returns the device arguments they got."""
    calls: list[tuple[str, object]] = []

    def reader(name):
        def read(device=None):
            calls.append((name, device))
            if isinstance(_READINGS[name], Exception):
                raise _READINGS[name]
            return _READINGS[name]

        return read

    for name in _READINGS:
        monkeypatch.setattr(torch.cuda, name, reader(name))
    return calls


@pytest.mark.skipif(importlib.util.find_spec("pynvml") is not None, reason="nvidia-ml-py is installed")
def test_without_nvml_there_are_no_readings_and_no_error():
    with pytest.raises(ModuleNotFoundError):  # what torch does: the reading raises
        torch.cuda.utilization(0)
    assert monitor._nvml_readings(0) == {}


def test_nvml_readings_are_converted(fake_nvml):
    assert monitor._nvml_readings(1) == {
        "utilization_percent": 93.0,
        "memory_utilization_percent": 41.0,
        "temperature_c": 71.0,
        "power_w": 215.5,
    }
    assert sorted(fake_nvml) == [("memory_usage", 1), ("power_draw", 1), ("temperature", 1), ("utilization", 1)]


@pytest.mark.parametrize("error", [ModuleNotFoundError("no pynvml"), RuntimeError("not supported")])
def test_a_raising_reading_leaves_its_key_out(fake_nvml, monkeypatch, error):
    monkeypatch.setitem(_READINGS, "temperature", error)
    assert monitor._nvml_readings(0) == {"utilization_percent": 93.0, "memory_utilization_percent": 41.0,
                                         "power_w": 215.5}


def test_cuda_reading_combines_allocator_and_nvml(fake_nvml, monkeypatch):
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "memory_allocated", lambda i: 100 * (i + 1))
    monkeypatch.setattr(cuda, "memory_reserved", lambda i: 200 * (i + 1))
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda i: 150 * (i + 1))
    monkeypatch.setattr(cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=1000 * (i + 1)))
    stats = read_device_stats("cuda:1")
    assert stats == DeviceStats("cuda:1", 200, 400, 300, 2000, 93.0, 41.0, 71.0, 215.5)
    assert {device for _, device in fake_nvml} == {1}
    assert read_device_stats("cuda").device == "cuda:0" and read_device_stats().allocated_bytes == 100
    monkeypatch.setitem(_READINGS, "power_draw", RuntimeError("no power sensor"))
    assert "power_w" not in read_device_stats("cuda:0").as_dict()


@pytest.mark.gpu
def test_cuda_memory_readings():
    torch.cuda.reset_peak_memory_stats()
    x = torch.empty(64, 2**20, device="cuda")  # 256 MiB
    stats = read_device_stats()
    assert stats.device.startswith("cuda:")
    assert stats.allocated_bytes >= x.numel() * 4 and stats.reserved_bytes >= stats.allocated_bytes
    assert stats.peak_allocated_bytes >= stats.allocated_bytes and stats.total_bytes > stats.reserved_bytes
    del x


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("pynvml") is None, reason="needs nvidia-ml-py")
def test_nvml_readings_on_a_real_gpu():
    stats = read_device_stats()
    assert 0.0 <= stats.utilization_percent <= 100.0 and 0.0 <= stats.memory_utilization_percent <= 100.0
    assert 0.0 < stats.temperature_c < 120.0
    assert 1.0 < stats.power_w < 2000.0  # watts, not milliwatts
