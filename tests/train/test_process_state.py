"""A run leaves the process as it found it: generators, deterministic and cuDNN switches, threads, handlers."""

from __future__ import annotations

import random
import signal

import numpy as np
import torch
from _train_workers import odd_process

from yolokit.data import DetectionDataset, build_dataloader, make_shapes
from yolokit.predict import predict
from yolokit.testing import tiny_model
from yolokit.train.process_state import ProcessState, left_as_found
from yolokit.val import validate


def test_restore_puts_back_each_setting_and_differences_names_what_moved():
    with odd_process() as before:
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
        assert random.random() == _first_draw(11)            # the next draw is the one before the block's


def _first_draw(seed: int) -> float:
    state = random.getstate()
    random.seed(seed)
    value = random.random()
    random.setstate(state)
    return value


def test_validate_and_predict_leave_the_process_as_they_found_it(tmp_path):
    """A finished run: tests/train/test_trainer.py::test_two_epochs_write_the_run_folder; a stopped one:
    tests/train/test_resume_iters.py::test_ctrl_c_between_steps_drops_the_partial_step."""
    data = make_shapes(tmp_path / "set", n_train=1, n_val=4, imgsz=64)        # its data.yaml
    model = tiny_model("yolov8", num_classes=4).eval()
    with odd_process() as before:
        loader = build_dataloader(DetectionDataset(data, "val", imgsz=64, rect=True), 2, workers=1)
        assert validate(model, loader, num_classes=4)[0].images == 4
        assert ProcessState.capture().differences(before) == []
        assert len(predict(model, data.parent / "images" / "val", imgsz=64)) == 4
        assert ProcessState.capture().differences(before) == []
