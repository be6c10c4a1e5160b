"""Short real runs of the Trainer on a tiny generated shapes set (64 px, 16 + 8 images)."""

import csv
import re

import _train_workers as workers
import pytest
import torch

import yolokit
from yolokit.accel import TrainingDiverged
from yolokit.data import make_shapes
from yolokit.interop.safe_load import pickle_globals
from yolokit.train import TrainConfig, Trainer, train
from yolokit.train.callbacks import Callback
from yolokit.train.checkpoint import load_checkpoint
from yolokit.train.process_state import ProcessState

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return str(make_shapes(tmp_path_factory.mktemp("shapes") / "set", n_train=16, n_val=8, imgsz=64))


def tiny(shapes, out, **kw):
    base = dict(data=shapes, imgsz=64, batch=8, nbs=16, epochs=2, workers=0, out=str(out), plots=False,
                warmup_epochs=0.0, close_mosaic=1)
    return TrainConfig(**{**base, **kw})


@pytest.mark.parametrize("model", ["yolov8n", "yolov3-tiny"])
def test_two_epochs_write_the_run_folder(shapes, tmp_path, model, capsys):
    with workers.odd_process() as before:
        result = train(tiny(shapes, tmp_path / "run", model=model, plots=True))
        assert ProcessState.capture().differences(before) == []  # the process as the run found it
    printed = capsys.readouterr()
    assert "channels_last=on" in printed.out  # the CPU default
    run = tmp_path / "run"
    assert result["run_dir"] == str(run)
    rows = list(csv.DictReader((run / "results.csv").open()))
    assert [r["epoch"] for r in rows] == ["1", "2"]
    assert {"precision", "recall", "mAP50", "mAP50-95", "lr", "seconds", "data%"} <= set(rows[0])
    losses = [k for k in rows[0] if k.startswith("train/")]
    assert losses and all(float(r[k]) > 0 for r in rows for k in losses)
    assert all(0 <= float(r["data%"]) <= 100 for r in rows)
    for row in rows:   # each epoch's bar ends on the means results.csv holds; memory is the process's RSS
        shown = [seg for seg in re.split(r"[\r\n]", printed.err) if seg.startswith(f"epoch {row['epoch']}/2")]
        last = dict(re.findall(r"(\w+)=([^,\]]+)", shown[-1]))
        assert {k: float(last[k.split("/")[1]]) for k in losses} == pytest.approx(
            {k: float(row[k]) for k in losses}, abs=5e-4)
        assert last["data"] == f"{float(row['data%']):.0f}%" and 0.05 < float(last["mem"].rstrip("G")) < 64
    assert TrainConfig.from_yaml(run / "config.yaml").model == model
    last = load_checkpoint(run / "weights" / "last.pt")
    assert last["epoch"] == 2 and last["train_config"]["model"] == model
    for name in ("last.pt", "best.pt", "model.pt"):   # no module path stored: moving a module keeps old runs loading
        assert not [g for g in pickle_globals(run / "weights" / name) if g.startswith("yolokit")], name
    assert "!!python" not in (run / "config.yaml").read_text()
    best = torch.load(run / "weights" / "best.pt", weights_only=True)    # the weights only: what a run keeps small
    assert {"state_dict", "config", "names", "train_config", "epoch", "fitness"} <= set(best)
    assert "optimizer" not in best and "ema" not in best
    assert all(t.dtype == torch.float16 for t in best["state_dict"].values() if t.is_floating_point())
    assert best["epoch"] in (1, 2) and yolokit.load(run / "weights" / "best.pt").num_classes == 4
    sizes = {p.name: p.stat().st_size for p in (run / "weights").iterdir()}
    assert sizes["best.pt"] < 0.6 * sizes["last.pt"] / 2 and abs(sizes["best.pt"] - sizes["model.pt"]) < 4096
    final = yolokit.load(run / "weights" / "model.pt")
    assert final.name == model and final.num_classes == 4
    resumable = yolokit.load(run / "weights" / "last.pt")     # its EMA weights and names, as model.pt has them
    assert resumable.names == final.names == ["circle", "rectangle", "triangle", "star"]
    ema = last["ema"]["module"]
    assert all(torch.equal(v, ema[k]) for k, v in resumable.state_dict().items())   # not last["model"]'s
    assert any(not torch.equal(v, last["model"][k]) for k, v in ema.items() if v.is_floating_point())
    saved = torch.load(run / "weights" / "model.pt", weights_only=True)["state_dict"]
    assert all(t.is_contiguous() for t in saved.values())
    assert {p.name for p in run.iterdir()} >= {"results.png", "pr_curve.png", "f1_curve.png",
                                                 "confusion_matrix_normalized.png", "val_predictions.jpg"}
    assert not {"tensorboard", "wandb", "steps.csv", "trackers.json"} & {p.name for p in run.iterdir()}  # none asked


class StopAfter(Callback):
    """Simulates a run killed right after epoch ``k`` (its checkpoint written)."""

    def __init__(self, k):
        self.k = k

    def on_epoch_end(self, row):
        if row["epoch"] == self.k:
            raise KeyboardInterrupt


def test_resume_is_exact(shapes, tmp_path):
    full = tiny(shapes, tmp_path / "full", epochs=3, close_mosaic=1)
    train(full)
    with pytest.raises(KeyboardInterrupt):
        Trainer(full.replace(out=str(tmp_path / "part")), callbacks=[StopAfter(1)]).fit()
    assert load_checkpoint(tmp_path / "part" / "weights" / "last.pt")["epoch"] == 1
    train(TrainConfig(resume=str(tmp_path / "part")))
    a = load_checkpoint(tmp_path / "full" / "weights" / "last.pt")
    b = load_checkpoint(tmp_path / "part" / "weights" / "last.pt")
    assert b["epoch"] == 3
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    for key, value in a["ema"]["module"].items():
        assert torch.equal(value, b["ema"]["module"][key]), key
    rows = list(csv.DictReader((tmp_path / "part" / "results.csv").open()))
    assert [r["epoch"] for r in rows] == ["1", "2", "3"]


def test_resume_can_extend_the_run(shapes, tmp_path):
    train(tiny(shapes, tmp_path / "run", epochs=1))
    train(TrainConfig(resume=str(tmp_path / "run"), epochs=2))
    state = load_checkpoint(tmp_path / "run" / "weights" / "last.pt")
    assert state["epoch"] == 2 and state["train_config"]["epochs"] == 2
    plan = state["plan"]          # the runtime plan the run trained with, as plain values
    assert (plan["device"], plan["world"], plan["batch"], plan["per_rank"]) == ("cpu", 1, state["batch"],
                                                                                state["batch"])
    assert plan["images_per_step"] == plan["accumulate"] * plan["batch"] and plan["steps_per_epoch"] >= 1


def test_nan_loss_stops_with_a_clear_message_and_keeps_the_last_checkpoint(shapes, tmp_path, monkeypatch):
    from yolokit.losses import YOLOv8Loss

    original = YOLOv8Loss.forward
    calls = {"n": 0}

    def poisoned(self, maps, targets, **kw):
        calls["n"] += 1
        total, parts = original(self, maps, targets, **kw)
        if calls["n"] > 2:  # the first epoch (2 batches) trains normally
            total = total * float("nan")
            parts = {k: v * float("nan") for k, v in parts.items()}
        return total, parts

    monkeypatch.setattr(YOLOv8Loss, "forward", poisoned)
    with pytest.raises(TrainingDiverged, match="not finite"):
        train(tiny(shapes, tmp_path / "run", epochs=5, max_bad_steps=2))
    state = load_checkpoint(tmp_path / "run" / "weights" / "last.pt")
    assert state["epoch"] == 1
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())


def test_interrupt_writes_a_resumable_checkpoint(shapes, tmp_path, monkeypatch):
    import yolokit.train.step as step

    calls = {"n": 0}
    original = step.retry_step  # the optimizer step of train_step

    def interrupted(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return original(*args, **kw)

    monkeypatch.setattr(step, "retry_step", interrupted)
    rec = Recorder()
    with pytest.raises(KeyboardInterrupt):
        Trainer(tiny(shapes, tmp_path / "run", nbs=8, epochs=2), callbacks=[rec]).fit()
    monkeypatch.undo()
    assert [c for c in rec.calls if c[0] in ("on_interrupt", "on_train_end", "on_export")] == [
        ("on_interrupt", (1, tmp_path / "run")), ("on_train_end", ())]  # one step taken, no final weights
    state = load_checkpoint(tmp_path / "run" / "weights" / "last.pt")
    assert state["epoch"] == 0  # the interrupted first epoch restarts on resume
    result = train(TrainConfig(resume=str(tmp_path / "run")))
    assert load_checkpoint(tmp_path / "run" / "weights" / "last.pt")["epoch"] == 2 and "mAP50" in result


def test_a_ctrl_c_right_after_the_checkpoint_keeps_the_epochs_results_row(shapes, tmp_path, monkeypatch):
    """The row of an epoch whose last.pt is on disk is in results.csv too: resume never loses it, nor repeats it."""
    import os
    import signal

    from yolokit.train.checkpoint import WeightsFolder

    real = WeightsFolder.save

    def save_then_ctrl_c(self, state, name, **kw):
        real(self, state, name, **kw)
        if name == "last.pt" and state["epoch"] == 1:
            os.kill(os.getpid(), signal.SIGINT)      # as a terminal would, between the checkpoint and the row

    monkeypatch.setattr(WeightsFolder, "save", save_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        train(tiny(shapes, tmp_path / "run"))
    monkeypatch.undo()
    rows = lambda: [r["epoch"] for r in csv.DictReader((tmp_path / "run" / "results.csv").open())]  # noqa: E731
    assert load_checkpoint(tmp_path / "run" / "weights" / "last.pt")["epoch"] == 1 and rows() == ["1"]
    train(TrainConfig(resume=str(tmp_path / "run")))
    assert rows() == ["1", "2"]


class Recorder(Callback):
    """Every hook call, in order, with its arguments."""

    def __init__(self):
        self.calls = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            return lambda *args: self.calls.append((name, args))
        return super().__getattribute__(name)


def test_everything_a_run_reports_goes_through_the_callbacks(shapes, tmp_path, monkeypatch, capsys):
    from yolokit.train import callbacks

    written = []
    monkeypatch.setattr(callbacks.tqdm, "write", lambda text, *a, **k: written.append(text))
    yolokit.save(yolokit.create_model("yolov8n", num_classes=7), tmp_path / "w.safetensors")
    rec = Recorder()
    # patience 1: the first validation that does not beat the best stops the run (the seeded
    # 16-image run reaches one before epoch 4; the assertions below would catch it if not)
    Trainer(tiny(shapes, tmp_path / "run", epochs=4, patience=1, weights=str(tmp_path / "w.safetensors")),
            callbacks=[rec]).fit()
    assert capsys.readouterr().out == ""  # the trainer printed nothing beside its callbacks
    names = [n for n, _ in rec.calls]
    assert names[:3] == ["on_setup_end", "on_train_start", "on_epoch_start"]
    assert names[-3:] == ["on_early_stop", "on_export", "on_train_end"]   # trackers send the weights at the end
    summary = rec.calls[0][1][0]
    assert {k: summary[k] for k in ("batch", "per_process", "accumulate", "step_batch", "world", "classes")} == \
        {"batch": 8, "per_process": 8, "accumulate": 2, "step_batch": 16, "world": 1, "classes": 4}
    assert len(summary["notes"]) == 1 and "the weights have 7 classes, the data 4" in summary["notes"][0]
    (epoch, patience), = [args for n, args in rec.calls if n == "on_early_stop"]
    assert patience == 1 and names.count("on_epoch_end") == epoch + 1 < 4
    assert rec.calls[-2][1] == (tmp_path / "run" / "weights" / "model.pt",) and rec.calls[-2][1][0].is_file()
    # on_log: once per optimizer step on the CPU (accumulate 2: every other batch), steps counted in the run
    logs = [args for n, args in rec.calls if n == "on_log"]
    batches = names.count("on_batch_end")
    assert [step for step, _ in logs] == list(range(1, len(logs) + 1)) and len(logs) >= batches // 2
    assert all(set(values) == {"step/box", "step/cls", "step/dfl", "step/lr"} for _, values in logs)
    assert written[0].startswith("yolokit train: yolov8n on ") and "batch 8 (8 per process) x 2 accumulation" in \
        written[0]
    config_line = f"config: {tmp_path / 'run' / 'config.yaml'} (model=yolov8n, data="   # the fields set, one line
    assert written[1].startswith(config_line) and "\n" not in written[1]
    assert written[2] == summary["notes"][0]
    assert f"early stop after epoch {epoch + 1}: no improvement for 1 validations" in written
    assert written[-1] == f"results in {tmp_path / 'run'}"


def test_bad_inputs_are_named(shapes, tmp_path):
    with pytest.raises(ValueError, match="yolov9"):
        train(tiny(shapes, tmp_path / "a", model="yolov9"))
    with pytest.raises(Exception, match="missing.yaml"):
        train(tiny(str(tmp_path / "missing.yaml"), tmp_path / "b"))


def test_two_processes_with_gloo_and_your_callbacks(shapes, tmp_path):
    """``train(config, callbacks=...)`` with ``devices=2``: yours reach the ranks, on rank 0 unless they ask
    for every rank."""
    log = tmp_path / "epochs.txt"
    result = train(tiny(shapes, tmp_path / "ddp", epochs=1, devices=2, batch=4),
                   callbacks=[workers.EpochLine(log), workers.EpochLine(log, every_rank=True)])
    assert (tmp_path / "ddp" / "weights" / "last.pt").is_file()
    assert 0.0 <= result["mAP50"] <= 1.0
    assert sorted(log.read_text().splitlines()) == ["all ranks: rank 0 epoch 1", "all ranks: rank 1 epoch 1",
                                                    "rank 0 epoch 1"]
