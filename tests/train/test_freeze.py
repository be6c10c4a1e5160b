"""Fine-tuning knobs: freeze (layers or names), save_period, dist_timeout; datasets built without waiting."""

import pytest
import torch

import yolokit
from yolokit.data import make_shapes
from yolokit.interop.ultralytics import LAYER_NAMES
from yolokit.train import TrainConfig, train
from yolokit.train.checkpoint import load_checkpoint
from yolokit.train.freeze import freeze, freeze_prefixes, layer_names


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return str(make_shapes(tmp_path_factory.mktemp("shapes") / "set", n_train=16, n_val=4, imgsz=64))


def test_freeze_n_counts_layers_as_ultralytics_does():
    model = yolokit.create_model("yolov8n", num_classes=3)
    layers = layer_names(model)
    assert layers[:10] == [LAYER_NAMES[i] for i in range(10)]      # freeze=10: the backbone in both
    assert freeze_prefixes(model, 10) == layers[:10] and layers[-3:] == ["head.box", "head.cls", "head.dfl"]
    assert freeze_prefixes(model, "backbone, neck.top_down4") == ["backbone", "neck.top_down4"]
    assert freeze_prefixes(model, None) == freeze_prefixes(model, 0) == []
    with pytest.raises(ValueError, match=f"freeze=99: the model has {len(layers)} layers"):
        freeze_prefixes(model, 99)
    with pytest.raises(ValueError, match="freeze names no parameters of the model: backbone.nothing"):
        freeze_prefixes(model, "backbone,backbone.nothing")
    count = freeze(model, ["backbone"])
    assert count == sum(p.numel() for n, p in model.named_parameters() if n.startswith("backbone."))
    assert all(not p.requires_grad for n, p in model.named_parameters() if n.startswith("backbone."))
    assert all(p.requires_grad for n, p in model.named_parameters() if n.startswith("neck."))
    assert len(layer_names(yolokit.create_model("yolov3-tiny"))) > 5


def test_freeze_n_freezes_the_first_n_rows_of_a_model_yaml():
    """Ultralytics' freeze=N freezes model.0 .. model.N-1, rows without parameters included."""
    model = yolokit.create_model("yolo11n.yaml", num_classes=3)
    layers = layer_names(model)
    assert layers == [f"backbone.{i}" for i in range(11)] + [f"neck.{i}" for i in range(11, 23)] + ["head"]
    frozen = freeze_prefixes(model, 13)     # the backbone, the Upsample (11), the Concat (12)
    assert frozen[-2:] == ["neck.11", "neck.12"]
    freeze(model, frozen)
    assert all(not p.requires_grad for n, p in model.named_parameters() if n.startswith("backbone."))
    assert all(p.requires_grad for n, p in model.named_parameters() if n.startswith("neck."))
    with torch.device("meta"):
        stacked = layer_names(yolokit.create_model("yolov3.yaml"))   # row 6 stacks 8 residual blocks: one layer
    assert stacked[6:8] == ["backbone.6", "backbone.7"] and len(stacked) == 36


def test_config_reads_freeze_from_flags_and_yaml():
    assert TrainConfig(freeze="10").freeze == 10                       # the CLI gives a string
    assert TrainConfig(freeze=["backbone", "neck.down3"]).freeze == "backbone,neck.down3"   # a YAML list
    assert TrainConfig(classes="0,2").classes == [0, 2] and TrainConfig(classes=[3]).classes == [3]
    for bad, says in (({"freeze": -1}, "freeze must be >= 0"), ({"save_period": -2}, "save_period must be >= 0"),
                      ({"dist_timeout": 0}, "dist_timeout must be > 0 minutes"),
                      ({"fraction": 1.5}, "fraction must be in"), ({"classes": "cats"}, "classes must be class ids")):
        with pytest.raises(ValueError, match=says):
            TrainConfig(**bad)


def test_frozen_layers_stay_bit_identical_and_epochs_are_kept(shapes, tmp_path):
    """A yolov8n fine-tuned with its backbone frozen: the backbone's weights and BatchNorm statistics
    (model and EMA) are the file's, bit for bit; the rest trained; save_period=1 keeps every epoch."""
    start = yolokit.create_model("yolov8n", num_classes=4)
    yolokit.save(start, tmp_path / "start.pt")
    before = {k: v.clone() for k, v in start.state_dict().items()}
    cfg = TrainConfig(data=shapes, weights=str(tmp_path / "start.pt"), freeze="backbone", imgsz=64, batch=8, nbs=8,
                      epochs=2, workers=0, out=str(tmp_path / "run"), plots=False, warmup_epochs=0.0,
                      close_mosaic=1, save_period=1)
    train(cfg)
    weights = tmp_path / "run" / "weights"
    assert sorted(p.name for p in weights.glob("epoch*.pt")) == ["epoch1.pt", "epoch2.pt"]
    assert load_checkpoint(weights / "epoch1.pt")["epoch"] == 1
    state = load_checkpoint(weights / "last.pt")
    for source in (state["model"], state["ema"]["module"]):
        backbone = [k for k in before if k.startswith("backbone.")]
        assert backbone and all(torch.equal(source[k], before[k]) for k in backbone), "the backbone moved"
        assert any("running_mean" in k for k in backbone)
        moved = [k for k in before if k.startswith("neck.") and before[k].is_floating_point()
                 and not torch.equal(source[k], before[k])]
        assert moved, "nothing outside the frozen part trained"


def test_datasets_are_built_without_a_collective_and_the_timeout_reaches_the_group(shapes, monkeypatch):
    """Every rank scans its datasets itself (a rank waiting for rank 0's scan in a barrier would trip
    the collective timeout), and dist_timeout (minutes) is the process group's timeout."""
    from yolokit.accel import distributed
    from yolokit.train import build, plan

    def no_collective(*args, **kwargs):
        raise AssertionError("a collective while building the datasets")

    monkeypatch.setattr(distributed, "barrier", no_collective)
    monkeypatch.setattr(distributed, "broadcast_object", no_collective)
    procs = plan.Processes(torch.device("cpu"), rank=0, local_rank=0, world=1, local_world=1)
    train_set, val_set = build.build_datasets(TrainConfig(data=shapes, imgsz=64), procs)
    assert (len(train_set), len(val_set)) == (16, 4)
    seen = {}
    monkeypatch.setattr(plan.distributed, "setup", lambda **kw: seen.update(kw) or torch.device("cpu"))
    plan.start_processes(TrainConfig(dist_timeout=180))
    assert seen == {"device": "auto", "timeout": 180 * 60}


def test_select_draws_a_seeded_subset_and_filters_classes():
    import numpy as np

    from yolokit.data.sources.labels import SplitIndex
    from yolokit.data.sources.selection import select

    n = 40
    labels = [np.array([[i % 4, 0, 0, 5, 5], [(i + 1) % 4, 1, 1, 6, 6]], np.float32) for i in range(n)]
    index = SplitIndex([f"{i}.jpg" for i in range(n)], np.zeros((n, 2), np.int32), labels, ["a", "b", "c", "d"])
    half, notes = select(index, fraction=0.25, seed=7)
    again, _ = select(index, fraction=0.25, seed=7)          # what every rank, and a resumed run, draws
    other, _ = select(index, fraction=0.25, seed=8)
    assert len(half) == 10 and half.paths == again.paths != other.paths
    assert half.paths == sorted(half.paths, key=lambda p: int(p.split(".")[0]))   # original order kept
    assert notes == ["fraction 0.25: 10 of 40 images (seed 7)"]
    kept, notes = select(index, classes=[1, 3])
    assert len(kept) == n and all(set(x[:, 0].tolist()) <= {1.0, 3.0} for x in kept.labels)
    assert sum(len(x) for x in kept.labels) == 40 and notes == [
        "classes 1, 3 (b, d): 40 of 80 labels of other classes dropped"]
    one, notes = select(index, single_cls=True)
    assert one.names == ["object"] and all((x[:, 0] == 0).all() for x in one.labels)
    assert all(np.array_equal(x[:, 1:], y[:, 1:]) for x, y in zip(one.labels, labels, strict=True))
    for bad, says in (({"fraction": 0.0}, "fraction must be in"), ({"classes": [4]}, "the data has classes 0..3")):
        with pytest.raises(ValueError, match=says):
            select(index, **bad)


def test_a_run_on_a_fraction_of_some_classes_and_one_as_single_class(shapes, tmp_path, monkeypatch, capsys):
    from yolokit.losses import YOLOv8Loss

    seen = set()
    original = YOLOv8Loss.forward

    def spy(self, maps, targets, max_boxes=None):
        seen.update(targets[:, 1].long().tolist())
        return original(self, maps, targets, max_boxes=max_boxes)

    monkeypatch.setattr(YOLOv8Loss, "forward", spy)
    base = dict(data=shapes, imgsz=64, batch=4, nbs=4, epochs=1, workers=0, plots=False, warmup_epochs=0.0,
                close_mosaic=0)
    train(TrainConfig(**base, out=str(tmp_path / "part"), fraction=0.5, classes="0,2"))
    out = capsys.readouterr().out
    assert "train: fraction 0.5: 8 of 16 images (seed 0)" in out
    assert "train: classes 0, 2" in out and "labels of other classes dropped" in out
    assert seen and seen <= {0, 2}                             # no other class reached the loss
    state = load_checkpoint(tmp_path / "part" / "weights" / "last.pt")
    assert state["plan"]["steps_per_epoch"] == 2               # 8 images of the 16, batches of 4
    seen.clear()
    train(TrainConfig(**base, out=str(tmp_path / "one"), single_cls=True))
    model = yolokit.load(tmp_path / "one" / "weights" / "model.pt")
    assert model.num_classes == 1 and seen == {0}


def test_a_time_budget_stops_at_a_step_validated_and_saved_and_resume_goes_on(shapes, tmp_path, capsys):
    """A budget that runs out at once: the run stops after its first optimizer step (mid-epoch),
    validates, writes last.pt at that step and the final weights; each resume takes one more step."""
    out = tmp_path / "run"
    cfg = TrainConfig(data=shapes, imgsz=64, batch=4, nbs=4, epochs=1, workers=0, plots=False, warmup_epochs=0.0,
                      close_mosaic=0, out=str(out), time=1e-9)     # 16 images: 4 steps in the epoch
    train(cfg)
    printed = capsys.readouterr().out
    assert f"time budget of 1e-09 h used after 1 optimizer steps: continue with `yolokit train --resume {out}`" \
        in printed and "val: P" in printed
    state = load_checkpoint(out / "weights" / "last.pt")
    assert (state["epoch"], state["step_in_epoch"], state["steps"]) == (0, 1, 1)
    assert (out / "weights" / "model.pt").is_file() and not (out / "results.csv").exists()   # no partial row
    train(TrainConfig(resume=str(out)))                            # the saved budget again: one more step
    state = load_checkpoint(out / "weights" / "last.pt")
    assert (state["epoch"], state["step_in_epoch"], state["steps"]) == (0, 2, 2)
    with pytest.raises(ValueError, match="time must be >= 0 hours"):
        TrainConfig(time=-1)


def test_the_ema_leaves_frozen_tensors_bit_identical():
    """``d * x + (1 - d) * x`` need not round back to ``x``: averaged, a constant tensor drifts."""
    from yolokit.train.ema import ModelEMA

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))
    plain, held = ModelEMA(model, decay=0.9, tau=1.0), ModelEMA(model, decay=0.9, tau=1.0, frozen=["0"])
    for _ in range(20):               # the model does not change: only rounding can move the averages
        plain.update(model)
        held.update(model)
    assert not torch.equal(plain.module[0].weight, model[0].weight)      # the drift the option avoids
    assert torch.equal(held.module[0].weight, model[0].weight) and torch.equal(held.module[0].bias, model[0].bias)
