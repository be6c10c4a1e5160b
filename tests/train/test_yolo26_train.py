"""YOLO26 trained like ours: its loss and MuSGD in the trainer, exact resume, 1 = 2 processes, both
augmentation paths, fine-tuning from the reference trainer's checkpoint.

The model is our yolo26.yaml narrowed to width 1/16 (a user's copy with another scale, 0.17 M
parameters): every YOLO26 block, both head branches and the one-to-one loss, at a cost the CPU
suite can carry. 9 images in micro-batches of 2 make 5 per epoch; ``nbs`` 4 accumulates 2, so an
epoch is 3 optimizer steps (2, 2 and 1 micro-batches). One thread, as each spawned rank has.
"""

from __future__ import annotations

import csv
from pathlib import Path

import _train_workers as workers
import pytest
import torch
import yaml

import yolokit
from yolokit.accel import MuSGD
from yolokit.accel.launcher import launch
from yolokit.data import make_shapes
from yolokit.losses import YOLO26Loss
from yolokit.losses.yolo26 import branch_weights
from yolokit.models.spec_config import CFG
from yolokit.testing import assert_weights_equal
from yolokit.train import TrainConfig, Trainer
from yolokit.train.checkpoint import load_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clean_env", "forked_ranks")]
REFERENCE_CHECKPOINT = Path(__file__).parents[1] / "interop" / "fixtures" / "yolo26-tiny-last.pt"


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return str(make_shapes(tmp_path_factory.mktemp("shapes") / "set", n_train=9, n_val=4, imgsz=64))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    spec = yaml.safe_load((CFG / "yolo26.yaml").read_text())
    spec["scales"] = {"n": [0.50, 0.0625, 1024]}
    path = tmp_path_factory.mktemp("model") / "yolo26n-tiny.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return str(path)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def config(shapes, tiny, out, **kw) -> TrainConfig:
    base = dict(data=shapes, model=tiny, imgsz=64, batch=2, nbs=4, epochs=2, workers=0, out=str(out), plots=False,
                warmup_epochs=1.0, close_mosaic=1, mosaic_buffer=0, seed=5, optimizer="MuSGD", lr0=0.01)
    return TrainConfig(**{**base, **kw})



def test_yolo26_trains_with_its_loss_and_musgd_resumes_bit_for_bit_and_on_two_processes(shapes, tiny, tmp_path,
                                                                                          one_thread):
    reference = tmp_path / "reference"
    trainer = Trainer(config(shapes, tiny, reference))
    seen = []
    original = YOLO26Loss.set_epoch

    def recording(self, epoch, epochs):
        seen.append((epoch, epochs))
        return original(self, epoch, epochs)

    YOLO26Loss.set_epoch = recording
    try:
        trainer.fit()
    finally:
        YOLO26Loss.set_epoch = original
    parts = trainer.parts
    assert isinstance(parts.criterion, YOLO26Loss) and isinstance(parts.optimizer, MuSGD)
    assert seen == [(0, 2), (1, 2)] and parts.criterion.epoch_weights == branch_weights(1, 2) == (0.1, 0.9)
    boosted = {g["name"]: g["lr_scale"] for g in parts.optimizer.param_groups if g["lr_scale"] != 1.0}
    assert boosted and set(boosted.values()) == {3.0}                  # the class branches at 3x
    rows = list(csv.DictReader((reference / "results.csv").open()))
    assert {"train/box", "train/cls", "train/l1"} <= set(rows[0]) and "train/dfl" not in rows[0]
    assert all(float(r["train/l1"]) > 0 for r in rows)
    state = load_checkpoint(reference / "weights" / "last.pt")
    assert state["steps"] == 6 and any("muon_momentum_buffer" in s for s in state["optimizer"]["state"].values())

    crashed = tmp_path / "crashed"                                    # a crash in the second epoch's second step
    with pytest.raises(RuntimeError, match="simulated crash"):
        workers.fit_until(config(shapes, tiny, crashed, save_period_iters=1), at=8)
    assert load_checkpoint(crashed / "weights" / "last.pt")["steps"] == 4
    Trainer(TrainConfig(resume=str(crashed))).fit()
    a, b = load_checkpoint(reference / "weights" / "last.pt"), load_checkpoint(crashed / "weights" / "last.pt")
    assert_weights_equal(a["model"], b["model"])
    assert_weights_equal(a["ema"]["module"], b["ema"]["module"])
    for key, value in a["optimizer"]["state"].items():
        for name, buffer in value.items():
            assert torch.equal(b["optimizer"]["state"][key][name], buffer), (key, name)
    assert workers.timeless_rows(crashed) == workers.timeless_rows(reference)

    two = launch(workers.fit_recording, 2, config(shapes, tiny, tmp_path / "two", batch=4), timeout=600)
    assert two[0]["digests"] == two[1]["digests"] and len(set(two[0]["digests"])) == 6   # the ranks agree
    b = load_checkpoint(tmp_path / "two" / "weights" / "last.pt")
    worst = max(workers.relative(b["model"][k], v) for k, v in a["model"].items())
    assert 0.0 < worst < 1e-3, worst                                  # two separate computations, one training

    model = yolokit.load(reference / "weights" / "model.pt")
    assert model.end_to_end and model.num_classes == 4
    (det,) = model.predict(torch.rand(3, 64, 64), conf=0.0, nms=False, max_det=10)
    assert len(det) == 10


def test_auto_picks_musgd_for_yolo26_on_long_runs_and_the_bias_warmup_starts_at_its_rate(shapes, tiny, tmp_path):
    long = Trainer(config(shapes, tiny, tmp_path / "long", optimizer="auto", epochs=3334))   # 10,002 steps
    parts = long.setup()
    assert isinstance(parts.optimizer, MuSGD) and parts.schedule.warmup_bias_lr == 0.1
    short = Trainer(config(shapes, tiny, tmp_path / "short", optimizer="auto"))
    parts = short.setup()
    assert isinstance(parts.optimizer, torch.optim.AdamW) and parts.schedule.warmup_bias_lr == 0.1
    given_lr = Trainer(config(shapes, tiny, tmp_path / "given_lr", optimizer="auto", warmup_bias_lr=0.0)).setup()
    assert given_lr.schedule.warmup_bias_lr == 0.0                     # a value given is kept (the reference's 0)
    v8 = Trainer(config(shapes, "yolov8n", tmp_path / "v8", optimizer="auto", epochs=3334)).setup()
    assert isinstance(v8.optimizer, torch.optim.SGD) and v8.schedule.warmup_bias_lr == 0.1   # as before
    given = yolokit.create_model(tiny, num_classes=4)                  # Trainer(config, model=...): a model of yours
    parts = Trainer(config(shapes, None, tmp_path / "given", model=None), model=given).setup()
    assert isinstance(parts.criterion, YOLO26Loss) and parts.model is given and isinstance(parts.optimizer, MuSGD)


@pytest.mark.parametrize("augment_on", ["workers", "device"])
def test_both_augmentation_paths_train_it(shapes, tiny, tmp_path, augment_on):
    out = tmp_path / augment_on
    Trainer(config(shapes, tiny, out, epochs=1, augment_on=augment_on, optimizer="SGD")).fit()
    (row,) = list(csv.DictReader((out / "results.csv").open()))
    assert all(float(row[k]) > 0 for k in ("train/box", "train/cls", "train/l1"))


def test_fine_tuning_from_the_reference_trainers_checkpoint(shapes, tmp_path):
    out = tmp_path / "tuned"
    source = yolokit.load(REFERENCE_CHECKPOINT)                        # 3 classes; the shapes set has 4
    lines = []
    trainer = Trainer(config(shapes, None, out, model=None, weights=str(REFERENCE_CHECKPOINT), epochs=1, lr0=0.0,
                             warmup_epochs=0.0))
    import yolokit.train.build as build

    original = build.transfer_weights
    build.transfer_weights = lambda *a, **k: original(*a, **{**k, "report": lines.append})
    try:
        trainer.fit()
    finally:
        build.transfer_weights = original
    (line,) = lines
    assert "left as initialised: head.cls.*.2 and head.one2one_cls.*.2 (class scores: the weights have 3 classes, " \
        "the data 4)" in line and "another shape" not in line
    tuned = yolokit.load(out / "weights" / "model.pt")
    assert tuned.end_to_end and tuned.num_classes == 4
    theirs, ours = source.state_dict(), tuned.state_dict()
    tensors = [k for k in theirs if "num_batches" not in k]
    kept = [k for k in tensors if theirs[k].shape == ours[k].shape]
    assert len(kept) == len(tensors) - 12                              # 3 levels x 2 branches x (weight, bias)
    first = "backbone.0.conv.weight"
    assert torch.equal(ours[first], theirs[first].float())            # lr 0: the transferred weights as they were
    assert ours["head.one2one_cls.0.2.weight"].shape[0] == ours["head.cls.0.2.weight"].shape[0] == 4
