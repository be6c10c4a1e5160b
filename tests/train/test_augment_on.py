"""TrainConfig.augment_on: where the augmentation runs, resolved with the device's other choices, in real runs."""

from __future__ import annotations

import argparse

import pytest
import torch

import yolokit.train.step as step_module
from yolokit.data import make_shapes
from yolokit.testing import assert_weights_equal
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
    assert config_from_args(parser.parse_args(["--compile-augment"])).compile_augment is True
    assert config_from_args(parser.parse_args([])).compile_augment is False
    assert _settings(TrainConfig(compile_augment=True)).compile_augment


@pytest.fixture(scope="module")
def shapes128(tmp_path_factory):
    return str(make_shapes(tmp_path_factory.mktemp("shapes128") / "set", n_train=8, n_val=2, imgsz=128))


def _spy(monkeypatch) -> list[dict]:
    seen, to_device = [], step_module.to_device

    def loaded(batch, device, **kw):
        seen.append({k: torch.as_tensor(batch[k]).clone() for k in ("aug_frame", "aug_shape") if k in batch})
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


@pytest.mark.usefixtures("clean_env")
def test_compile_augment_reaches_every_batchs_to_device(shapes128, tmp_path, monkeypatch):
    """The trainer asks `to_device` for the compiled pass (its images: tests/data/test_fused_pass.py;
    here the eager pass runs, so the test compiles nothing)."""
    asked, real = [], step_module.to_device

    def spy(batch, device, **kw):
        asked.append(kw.get("compiled"))
        return real(batch, device, **{**kw, "compiled": False})

    monkeypatch.setattr(step_module, "to_device", spy)
    cfg = TrainConfig(data=shapes128, model="yolov8n", imgsz=64, batch=4, nbs=4, epochs=1, workers=0,
                      out=str(tmp_path / "run"), plots=False, augment_on="device", compile_augment=True)
    Trainer(cfg).fit()
    assert asked == [True, True]                                        # 8 images, batch 4


@pytest.mark.slow
@pytest.mark.extended   # 25 s; the crash and resume: test_resume_iters.py; the device path's recipes on resume:
@pytest.mark.usefixtures("clean_env")   # tests/data/test_device_augment.py (resume_mid_epoch)
def test_a_crashed_run_on_the_device_path_resumes_bit_for_bit(tmp_path):
    """Three epochs (Mosaic, then closed), last.pt every 2 steps, a crash in step 5, resumed: the
    final weights, EMA and momentum equal the uninterrupted run's, results.csv too."""
    import csv

    import _train_workers as workers

    from yolokit.train.checkpoint import load_checkpoint

    data = str(make_shapes(tmp_path / "set", n_train=13, n_val=4, imgsz=64))

    def config(out, **kw):
        return TrainConfig(data=data, imgsz=64, batch=2, nbs=6, epochs=3, workers=0, out=str(out), plots=False,
                           warmup_epochs=1.0, close_mosaic=1, mosaic_buffer=0, seed=3, optimizer="SGD", lr0=0.01,
                           save_period_iters=2, augment_on="device", **kw)

    Trainer(config(tmp_path / "reference")).fit()
    with pytest.raises(RuntimeError, match="simulated crash"):
        workers.fit_until(config(tmp_path / "run"), at=12)              # in step 5: last.pt is step 4's
    Trainer(TrainConfig(resume=str(tmp_path / "run"))).fit()
    a, b = (load_checkpoint(tmp_path / name / "weights" / "last.pt") for name in ("reference", "run"))
    assert a["steps"] == b["steps"] == 9 and b["train_config"]["augment_on"] == "device"
    assert_weights_equal(a["model"], b["model"])
    assert_weights_equal(a["ema"]["module"], b["ema"]["module"])
    for key, value in a["optimizer"]["state"].items():
        assert torch.equal(b["optimizer"]["state"][key]["momentum_buffer"], value["momentum_buffer"]), key
    rows = [[{k: v for k, v in r.items() if k not in ("seconds", "data%")}
             for r in csv.DictReader((tmp_path / name / "results.csv").open())] for name in ("reference", "run")]
    assert rows[0] == rows[1] and len(rows[0]) == 3


@pytest.mark.slow
@pytest.mark.extended   # the recipes are per rank as the images are; a crashed run resumes bit for bit above
@pytest.mark.usefixtures("clean_env")
def test_two_processes_augment_on_the_device(shapes128, tmp_path):
    """Two ranks (gloo on the CPU), each making its own micro-batches' images on its device: the
    same weights on both after every optimizer step, to the end."""
    import _train_workers as workers

    from yolokit.accel.launcher import launch

    cfg = TrainConfig(data=shapes128, model="yolov8n", imgsz=128, batch=4, nbs=4, epochs=2, workers=0,
                      out=str(tmp_path / "run"), plots=False, warmup_epochs=0.0, close_mosaic=1, seed=3,
                      augment_on="device")
    ranks = launch(workers.fit_recording, 2, cfg, timeout=300)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert len(ranks[0]["digests"]) == 4 and ranks[0]["digests"] == ranks[1]["digests"]
    assert len(set(ranks[0]["digests"])) == 4                            # the weights moved at every step


@pytest.mark.usefixtures("clean_env")
def test_a_step_split_after_running_out_of_memory_keeps_its_images_and_labels(shapes128, tmp_path, monkeypatch):
    """The first step runs out of memory once: its recipe batch is split in two micro-batches that
    make, between them, the same images and labels as the whole batch (the sources stay whole in
    each, the per-image recipes are cut)."""
    real, calls, failed = step_module.forward_backward, [], []

    def forward_backward(net, criterion, precision, images, targets, **kw):
        calls.append((images.clone(), targets.clone()))
        if len(calls) == 1:
            failed.append(len(images))
            raise torch.OutOfMemoryError("injected: the first micro-batch of 4 images")
        return real(net, criterion, precision, images, targets, **kw)

    monkeypatch.setattr(step_module, "forward_backward", forward_backward)
    cfg = TrainConfig(data=shapes128, model="yolov8n", imgsz=64, batch=4, nbs=4, epochs=1, workers=0, plots=False,
                      out=str(tmp_path / "run"), augment_on="device", warmup_epochs=0.0)
    with pytest.warns(RuntimeWarning, match="out of memory"):
        Trainer(cfg).fit()
    (whole, labels), (first, first_labels), (second, second_labels) = calls[:3]
    assert failed == [4] and len(first) == len(second) == 2
    assert torch.equal(torch.cat([first, second]), whole)             # the same pixels, bit for bit
    second_labels[:, 0] += 2
    assert torch.equal(torch.cat([first_labels, second_labels]), labels)
    assert len(calls) == 5 and all(len(c[0]) == 2 for c in calls[1:])   # 8 images: the next batch split too
