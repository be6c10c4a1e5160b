"""Is the GPU fed: the device's readings per epoch next to data%, and one warning per cause (a fake reader)."""

from __future__ import annotations

import csv
import time
import warnings

import pytest
import torch

from yolokit.accel.monitor import DeviceStats
from yolokit.data import make_shapes
from yolokit.train import TrainConfig, Trainer, feeding
from yolokit.train.feeding import EpochMonitor


def fake_reader(util=30.0, temp=85.0, power=290.0):
    def read(device):
        return DeviceStats(device="cuda:0", allocated_bytes=2**30, reserved_bytes=2**31, peak_allocated_bytes=3 * 2**29,
                           utilization_percent=util, temperature_c=temp, power_w=power, temperature_limit_c=88.0,
                           power_limit_w=300.0)
    return read


def test_an_epoch_gives_its_columns_and_each_warning_once():
    monitor = EpochMonitor(torch.device("cpu"), interval=0.01, reader=fake_reader())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(3):
            monitor.start()
            time.sleep(0.05)
            row = monitor.stop(epoch, data_share=0.6, knobs="2 workers, cache False")
    assert row == {"gpu_busy%": 30.0, "gpu_mem_peak_gb": 1.5, "gpu_temp_c": 85.0, "gpu_power_w": 290.0}
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages                          # one per cause, not one per epoch
    assert messages[0].startswith("the GPU was busy 30% of epoch 1 while the training loop waited for data 60%")
    assert "--workers" in messages[0] and "--augment-on device" in messages[0] and "now 2 workers" in messages[0]
    assert messages[1] == ("the GPU ran at 85 C of its 88 C slowdown temperature and 290 W of its 300 W power "
                           "limit over epoch 1: its clocks are likely throttled (check its cooling and power cap)")


def test_a_fed_cool_gpu_warns_nothing_and_a_cpu_reading_adds_no_column():
    monitor = EpochMonitor(torch.device("cpu"), interval=0.01, reader=fake_reader(util=97.0, temp=60.0, power=150.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monitor.start()
        assert monitor.stop(0, data_share=0.6, knobs="")["gpu_busy%"] == 97.0     # busy: data% is only waiting
        monitor.start()
        assert monitor.stop(0, data_share=0.01, knobs="")["gpu_busy%"] == 97.0
    cpu = EpochMonitor(torch.device("cpu"), interval=0.01, reader=lambda d: DeviceStats(device="cpu"))
    cpu.start()
    assert cpu.stop(0, data_share=0.9, knobs="") == {}


@pytest.mark.slow
def test_a_starved_run_reports_its_device_per_epoch_and_warns_once(tmp_path, monkeypatch, capsys):
    """A run whose loop waited for data 60% of its time (told, not timed) on a device reading 30% busy."""
    monkeypatch.setattr(feeding, "read_device_stats", fake_reader())
    monkeypatch.setattr(feeding.DataWait, "share", lambda self: 0.6)
    data = make_shapes(tmp_path / "shapes", n_train=8, n_val=4, imgsz=64)
    config = TrainConfig(data=str(data), imgsz=64, batch=4, nbs=4, epochs=2, workers=0, plots=False, monitor=True,
                         out=str(tmp_path / "run"))
    with pytest.warns(RuntimeWarning) as caught:
        Trainer(config).fit()
    starved = [w for w in caught if "the loader does not keep up" in str(w.message)]
    assert len(starved) == 1 and "now 0 workers, cache False" in str(starved[0].message)
    rows = list(csv.DictReader((tmp_path / "run" / "results.csv").open()))
    assert [float(r["gpu_busy%"]) for r in rows] == [30.0, 30.0] and [r["data%"] for r in rows] == ["60", "60"]
    assert all(float(r["gpu_temp_c"]) == 85.0 and float(r["gpu_mem_peak_gb"]) == 1.5 for r in rows)
    assert capsys.readouterr().out.count("  gpu: busy 30%  peak 1.50 GB  max 85 C  290 W  data 60%") == 2
