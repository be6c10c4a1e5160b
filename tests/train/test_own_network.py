"""Your own network, trained like ours: a four-level P2 model, YOLO11 and a timm backbone.

Each trains with the trainer as the built-in variants do, resumes bit for bit after a crash
mid-epoch, and (the YAML models) trains on two processes what one process trains: the ranks
hold the same bits after every step, equal to one process's up to the rounding of sums over
ranks instead of micro-batches (as tests/train/test_distributed_training.py checks the
built-in variants).
9 images in micro-batches of 2 make 5 per epoch (the last holds 1 image); ``nbs`` 4
accumulates 2, so an epoch is 3 steps (2, 2 and 1 micro-batches) and, on two processes, rank 1
joins the last step with nothing of its own. One thread, as each spawned rank has on 2 cores.
"""

from __future__ import annotations

import csv

import _train_workers as workers
import pytest
import torch

from yolokit.accel.launcher import launch
from yolokit.data import make_shapes
from yolokit.testing import assert_weights_equal
from yolokit.train import TrainConfig, Trainer
from yolokit.train.checkpoint import load_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clean_env", "forked_ranks")]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return str(make_shapes(tmp_path_factory.mktemp("shapes") / "set", n_train=9, n_val=4, imgsz=64))


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def config(shapes, out, **kw) -> TrainConfig:
    base = dict(data=shapes, imgsz=64, batch=2, nbs=4, epochs=2, workers=0, out=str(out), plots=False,
                warmup_epochs=1.0, warmup_bias_lr=0.0, close_mosaic=1, mosaic_buffer=0, seed=7, optimizer="SGD",
                lr0=0.01)
    return TrainConfig(**{**base, **kw})



def assert_same_run(reference, other):
    a, b = load_checkpoint(reference / "weights" / "last.pt"), load_checkpoint(other / "weights" / "last.pt")
    assert (a["epoch"], a["steps"]) == (b["epoch"], b["steps"]) == (2, 6)
    assert_weights_equal(a["model"], b["model"])
    assert_weights_equal(a["ema"]["module"], b["ema"]["module"])
    assert workers.timeless_rows(other) == workers.timeless_rows(reference)


# extended: a model YAML (tests/fixtures/tiny.yaml) resumes bit for bit in test_resume_iters.py and trains the same
# on 1 and N processes in test_distributed_training.py; yolo11n's blocks train a step in test_step_syncs.py, the P2
# head builds in tests/models
@pytest.mark.extended
@pytest.mark.parametrize("name, strides", [("yolov8n-p2.yaml", (4, 8, 16, 32)), ("yolo11n.yaml", (8, 16, 32))])
def test_a_yaml_model_resumes_bit_for_bit_and_trains_the_same_on_two_processes(shapes, tmp_path, one_thread,
                                                                                 name, strides):
    reference = tmp_path / "reference"
    recorded = workers.fit_recording(config(shapes, reference, model=name))
    assert len(set(recorded["digests"])) == 6                       # 6 optimizer steps, each changed the weights
    state = load_checkpoint(reference / "weights" / "last.pt")
    assert state["model_config"]["family"] == "spec" and state["model_config"]["name"] == name.removesuffix(".yaml")
    assert tuple(state["ema"]["module"]["head.dfl.conv.weight"].shape) == (1, 16, 1, 1)

    crashed = tmp_path / "crashed"                                  # a crash in the second epoch's second step
    with pytest.raises(RuntimeError, match="simulated crash"):
        workers.fit_until(config(shapes, crashed, model=name, save_period_iters=1), at=8)
    assert (load_checkpoint(crashed / "weights" / "last.pt")["steps"]) == 4
    Trainer(TrainConfig(resume=str(crashed))).fit()                 # the architecture comes from the checkpoint
    assert_same_run(reference, crashed)

    two = launch(workers.fit_recording, 2, config(shapes, tmp_path / "two", model=name, batch=4), timeout=600)
    assert two[0]["digests"] == two[1]["digests"] and len(two[0]["digests"]) == 6   # the ranks agree, every step
    a, b = load_checkpoint(reference / "weights" / "last.pt"), load_checkpoint(tmp_path / "two" / "weights" / "last.pt")
    assert a["steps"] == b["steps"] == 6
    worst = max(workers.relative(b[part][k], v) for part in ("model",) for k, v in a[part].items())
    worst = max(worst, *(workers.relative(b["ema"]["module"][k], v) for k, v in a["ema"]["module"].items()))
    assert 0.0 < worst < 1e-3, worst              # two separate computations, the same training
    import yolokit

    assert yolokit.load(reference / "weights" / "model.pt").strides == strides


def _timm_detector():
    from yolokit.models import Detector, TimmBackbone
    from yolokit.models.heads import DFLHead
    from yolokit.models.necks import YOLOv8PAN

    torch.manual_seed(0)
    backbone = TimmBackbone("mobilenetv3_small_050", out_indices=(2, 3, 4))
    neck = YOLOv8PAN(backbone.out_channels, depth=1)
    return Detector(backbone, neck, DFLHead(neck.out_channels, backbone.strides, num_classes=4), name="mnv3-pan")


def test_a_timm_backbone_under_a_pan_neck_trains_its_loss_falls_and_it_resumes_exactly(shapes, tmp_path, one_thread):
    pytest.importorskip("timm")
    reference = tmp_path / "reference"
    notes = []

    class Notes(workers.Callback):
        def on_setup_end(self, summary):
            notes.extend(summary["notes"])

    cfg = config(shapes, reference, epochs=4, tracker="csv")
    Trainer(cfg, callbacks=[Notes()], model=_timm_detector()).fit()
    steps = [float(r["step/cls"]) + float(r["step/box"]) for r in csv.DictReader((reference / "steps.csv").open())]
    assert len(steps) == 12 and sum(steps[-3:]) < 0.7 * sum(steps[:3]), steps   # the loss falls
    assert any("no weights/model.pt at the end: mnv3-pan holds no architecture" in n for n in notes)
    assert not (reference / "weights" / "model.pt").exists()
    assert load_checkpoint(reference / "weights" / "last.pt")["model_config"] is None

    crashed = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="simulated crash"):
        workers.fit_until(config(shapes, crashed, epochs=4, tracker="csv", save_period_iters=1), at=13,
                          model=_timm_detector())
    with pytest.raises(ValueError, match="trained a model given as an instance, .* pass it again"):
        Trainer(TrainConfig(resume=str(crashed))).fit()
    Trainer(TrainConfig(resume=str(crashed)), model=_timm_detector()).fit()
    a, b = load_checkpoint(reference / "weights" / "last.pt"), load_checkpoint(crashed / "weights" / "last.pt")
    assert a["steps"] == b["steps"] == 12
    assert_weights_equal(a["model"], b["model"])
    assert workers.timeless_rows(crashed) == workers.timeless_rows(reference)
