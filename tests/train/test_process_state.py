"""A run leaves the process as it found it: generators, deterministic and cuDNN switches, threads, handlers."""

from __future__ import annotations

import random
import signal

import numpy as np
import pytest
import torch

import yolokit
from yolokit.data import DetectionDataset, build_dataloader, make_shapes
from yolokit.predict import predict
from yolokit.train import TrainConfig, train
from yolokit.train.process_state import ProcessState, left_as_found
from yolokit.val import validate


def _odd_settings() -> None:
    """Settings no run uses, so that a run that changed one and did not put it back is seen."""
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.deterministic = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(2)
    signal.signal(signal.SIGTERM, _handler)


def _handler(signum, frame):
    pass


@pytest.fixture
def odd_process():
    saved = ProcessState.capture()
    _odd_settings()
    yield
    saved.restore()


def test_restore_puts_back_each_setting_and_differences_names_what_moved(odd_process):
    before = ProcessState.capture()
    with left_as_found():
        random.random(), np.random.rand(), torch.rand(1)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        torch.set_num_threads(1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        moved = ProcessState.capture().differences(before)
    assert set(moved) == {"python_rng", "numpy_rng", "torch_rng", "deterministic", "deterministic_warn_only",
                          "cudnn_benchmark", "num_threads", "handlers"}
    assert ProcessState.capture().differences(before) == []
    assert random.random() == _first_draw(11)                # the next draw is the one before the block's


def _first_draw(seed: int) -> float:
    state = random.getstate()
    random.seed(seed)
    value = random.random()
    random.setstate(state)
    return value


@pytest.mark.slow
def test_train_validate_and_predict_leave_the_process_as_they_found_it(tmp_path, odd_process):
    data = make_shapes(tmp_path / "set", n_train=8, n_val=4, imgsz=64)        # its data.yaml
    before = ProcessState.capture()
    metrics = train(TrainConfig(data=str(data), imgsz=64, epochs=1, batch=4, nbs=4, workers=1,
                                plots=False, out=str(tmp_path / "run"), verbose=False))
    assert ProcessState.capture().differences(before) == []
    model = yolokit.load(f"{metrics['run_dir']}/weights/model.pt").eval()
    loader = build_dataloader(DetectionDataset(data, "val", imgsz=64, rect=True), 4, workers=1)
    validate(model, loader, num_classes=4)
    assert ProcessState.capture().differences(before) == []
    assert len(list(predict(model, data.parent / "images" / "val", imgsz=64))) == 4
    assert ProcessState.capture().differences(before) == []
