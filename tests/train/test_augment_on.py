"""TrainConfig.augment_on: where the augmentation runs, resolved with the device's other choices, in real runs."""

from __future__ import annotations

import argparse

import pytest
import torch

import yolokit.train.step as step_module
from yolokit.data import make_shapes
from yolokit.train import TrainConfig, Trainer
from yolokit.train.config import add_config_flags, config_from_args
from yolokit.train.plan import Processes, device_settings


def _settings(cfg: TrainConfig):
    return device_settings(cfg, Processes(torch.device("cpu"), rank=0, local_rank=0, world=1, local_world=1))


def test_auto_is_the_workers_until_measured_and_device_is_honoured():
    assert TrainConfig().augment_on == "auto"
    assert _settings(TrainConfig()).augment_on == "workers"
    assert _settings(TrainConfig(augment_on="workers")).augment_on == "workers"
    assert _settings(TrainConfig(augment_on="device")).augment_on == "device"
    with pytest.raises(ValueError, match="augment_on must be"):
        TrainConfig(augment_on="gpu")


def test_the_command_line_flag():
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    assert config_from_args(parser.parse_args(["--augment-on", "device"])).augment_on == "device"
    assert config_from_args(parser.parse_args([])).augment_on == "auto"


@pytest.fixture(scope="module")
def shapes128(tmp_path_factory):
    return str(make_shapes(tmp_path_factory.mktemp("shapes128") / "set", n_train=8, n_val=2, imgsz=128))


def _spy(monkeypatch) -> list[dict]:
    seen, to_device = [], step_module.to_device

    def loaded(batch, device, **kw):
        seen.append({k: batch[k].clone() for k in ("aug_frame", "aug_shape") if k in batch})
        out = to_device(batch, device, **kw)
        seen[-1]["images"] = tuple(out["images"].shape)
        return out

    monkeypatch.setattr(step_module, "to_device", loaded)
    return seen


@pytest.mark.slow
@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize("rect", [False, True], ids=["close_mosaic", "rect"])
def test_a_run_augments_on_the_device(shapes128, tmp_path, monkeypatch, rect):
    seen = _spy(monkeypatch)
    cfg = TrainConfig(data=shapes128, model="yolov8n", imgsz=128, batch=4, nbs=4, epochs=2, workers=0,
                      out=str(tmp_path / "run"), plots=False, warmup_epochs=0.0, close_mosaic=1, seed=3,
                      augment_on="device", rect=rect)
    Trainer(cfg).fit()
    assert len(seen) == 4 and all("aug_frame" in s for s in seen)        # every batch made on the device
    frames = [set(s["aug_frame"][:, 0, 0].tolist()) for s in seen]
    if rect:                                                            # no Mosaic: the batch's own shape
        assert all(f <= {96, 128} for f in frames)
        assert any(s["images"][2:] != (128, 128) for s in seen)
    else:                                                               # Mosaic, then closed for the last epoch
        assert frames[:2] == [{256}, {256}] and frames[2:] == [{128}, {128}]
        assert all(s["images"] == (4, 3, 128, 128) for s in seen)
