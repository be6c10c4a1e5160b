"""A run the device stops (a CUDA error) says where and with which files, and never aborts without a word."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import yolokit.train.step as step_module
from yolokit.accel.devices import DeviceFailure, is_device_error
from yolokit.data import make_shapes
from yolokit.train import TrainConfig, Trainer

ASSERT = "CUDA error: device-side assert triggered"


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return str(make_shapes(tmp_path_factory.mktemp("shapes") / "set", n_train=12, n_val=4, imgsz=64))


def _failing_at(monkeypatch, call: int, error: BaseException, seen: list):
    original = step_module.micro_step

    def micro_step(parts, epoch, step, micro):
        seen.append(list(micro["paths"]))
        if len(seen) == call:
            raise error
        return original(parts, epoch, step, micro)

    monkeypatch.setattr(step_module, "micro_step", micro_step)


def test_a_cuda_error_names_the_step_and_the_files(shapes, tmp_path, monkeypatch, caplog):
    seen: list = []
    error = torch.AcceleratorError(ASSERT)
    _failing_at(monkeypatch, 7, error, seen)                       # epoch 2, its first batch
    cfg = TrainConfig(data=shapes, imgsz=64, batch=2, nbs=4, epochs=2, workers=0, plots=False,
                      out=str(tmp_path / "run"))
    with caplog.at_level("ERROR", logger="yolokit.train"), pytest.raises(DeviceFailure) as raised:
        Trainer(cfg).fit()
    text = str(raised.value)
    assert raised.value.__cause__ is error and raised.value.reported
    assert text.startswith(f"the device failed (AcceleratorError: {ASSERT}) in epoch 2, step 4, at batch 1 of 6")
    assert all(path in text for path in seen[-1] + seen[-2])      # this batch and the one before
    assert "the batch before (epoch 1, batch 6)" in text
    assert "CUDA_LAUNCH_BLOCKING=1" in text and "YOLOKIT_CHECK_INDICES=1" in text
    assert f"resume with yolokit train --resume {tmp_path / 'run'}" in text     # epoch 1 saved last.pt
    assert text in caplog.text                                      # said before the exception unwinds


def test_other_errors_pass_through_unchanged(shapes, tmp_path, monkeypatch):
    seen: list = []
    error = RuntimeError("the loss got a shape it did not expect")
    _failing_at(monkeypatch, 2, error, seen)
    cfg = TrainConfig(data=shapes, imgsz=64, batch=2, epochs=1, workers=0, plots=False, out=str(tmp_path / "run"))
    with pytest.raises(RuntimeError) as raised:
        Trainer(cfg).fit()
    assert raised.value is error


def test_what_counts_as_the_device_failing():
    assert is_device_error(torch.AcceleratorError(ASSERT))
    assert is_device_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_device_error(RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasGemmEx"))
    assert not is_device_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_device_error(RuntimeError("CUDNN_STATUS_ALLOC_FAILED"))          # out of memory: survivable
    assert not is_device_error(RuntimeError("CUDA error: out of memory"))
    assert not is_device_error(ValueError("CUDA error"))
    assert not is_device_error(RuntimeError("shape mismatch"))


@pytest.mark.slow
def test_the_command_says_it_and_exits_1(shapes, tmp_path):
    """``yolokit train`` when the device fails: the message once, a last line, exit status 1 (not an
    abort while CUDA memory is freed at exit), nothing left running."""
    script = textwrap.dedent(f"""
        import sys, torch
        import yolokit.train.step as s
        original, calls = s.micro_step, []
        def micro_step(*args):
            calls.append(1)
            if len(calls) == 3:
                raise torch.AcceleratorError({ASSERT!r})
            return original(*args)
        s.micro_step = micro_step
        from yolokit.cli import main
        sys.exit(main(["train", "--data", {shapes!r}, "--imgsz", "64", "--batch", "2", "--epochs", "1",
                       "--workers", "0", "--out", {str(tmp_path / "run")!r}]))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.count(f"the device failed (AcceleratorError: {ASSERT}) in epoch 1, step 1, at batch 3 of 6") == 1
    assert done.stderr.rstrip().endswith("yolokit train: stopped: the device failed (exit 1)")
    assert "Traceback" not in done.stderr and Path(tmp_path / "run").is_dir()
