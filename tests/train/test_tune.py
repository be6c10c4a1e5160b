"""Sweeps: search spaces read and checked, the pruner fed each epoch's metric, a joining worker, and a
4-trial study of 2 parallel workers through the real command, stopped by Ctrl-C and resumed, whose
best config retrains to its recorded value bit for bit on the CPU."""

from __future__ import annotations

import csv
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from _processes import alive, descendants
from _torchrun_env import subprocess_env

import yolokit
from yolokit.data import make_shapes
from yolokit.train import TrainConfig, Trainer
from yolokit.train.callbacks import Callback
from yolokit.train.sweeps.space import SearchSpace
from yolokit.train.trackers.base import Tracker

optuna = pytest.importorskip("optuna")


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):   # 16 training images, batch 8: 2 optimizer steps an epoch
    return str(make_shapes(tmp_path_factory.mktemp("shapes") / "set", n_train=16, n_val=4, imgsz=64))


SPACE = {"lr0": {"low": 1e-3, "high": 0.05, "log": True}, "momentum": {"low": 0.8, "high": 0.95},
         "hsv_s": {"low": 0.0, "high": 0.9}, "imgsz": {"low": 64, "high": 96, "step": 32},
         "model": {"choices": ["yolov8n"]}}


def base_config(shapes, **kw):
    # mosaic_buffer 0: a run resumed mid-epoch is the run uninterrupted (bit for bit on the CPU)
    return TrainConfig(**{**dict(data=shapes, imgsz=64, batch=8, nbs=8, epochs=2, workers=0, plots=False,
                                 warmup_epochs=0.0, close_mosaic=1, optimizer="SGD", mosaic_buffer=0), **kw})


# --- search spaces -------------------------------------------------------------------------------------------

def test_a_space_samples_within_its_bounds_with_the_fields_types():
    space = SearchSpace.from_dict(SPACE)
    assert [d.integer for d in space.dimensions] == [False, False, False, True, False]
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(40):
        values = space.suggest(study.ask())
        assert 1e-3 <= values["lr0"] <= 0.05 and 0.8 <= values["momentum"] <= 0.95 and 0 <= values["hsv_s"] <= 0.9
        assert values["imgsz"] in (64, 96) and isinstance(values["imgsz"], int) and values["model"] == "yolov8n"
        base_config("shapes").replace(**values)               # every sample is a valid config
    assert SearchSpace.from_dict(space.as_dict()).as_dict() == space.as_dict()    # what the study stores


@pytest.mark.parametrize("spec, message", [
    ({"lr0": [1e-4, 0.1]}, r"lr0: give a range \{low: \.\., high: \.\.\} .* or \{choices: \[\.\.\.\]\}"),
    ({"learning_rate": {"low": 0.1, "high": 0.2}}, "'learning_rate' is not a TrainConfig or augmentation field"),
    ({"out": {"choices": ["a", "b"]}}, "'out' is set by the sweep itself"),
    ({"lr0": {"low": 0.1, "high": 0.01}}, r"low \(0.1\) must be below high \(0.01\)"),
    ({"lr0": {"low": 0.0, "high": 0.1, "log": True}}, "a log range needs low > 0"),
    ({"imgsz": {"low": 64.0, "high": 128}}, "imgsz is a whole number"),
    ({"lr0": {"low": 0.01, "hi": 0.1}}, r"unknown keys \['hi'\]"),
    ({"model": {"choices": []}}, "choices is a non-empty list"),
])
def test_a_bad_space_names_the_file_and_the_field(tmp_path, spec, message):
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ValueError, match=rf"^{path}: .*{message}"):
        SearchSpace.load(path)


@pytest.mark.parametrize("kw, message", [
    ({"trials": 0}, "trials and parallel must be >= 1, got 0 and 1"),
    ({"parallel": 0}, "trials and parallel must be >= 1, got 2 and 0"),
    ({"keep_weights": -1}, "keep_weights must be >= 0, got -1"),
    ({"metric": "mAP75"}, "metric must be one of mAP50-95, "),
])
def test_the_sweep_arguments_are_checked_before_any_trial(tmp_path, kw, message):
    with pytest.raises(ValueError, match=message):
        yolokit.tune(SPACE, TrainConfig(), **{"trials": 2, "out": tmp_path / "study", **kw})
    assert not (tmp_path / "study").exists()


def test_a_space_is_checked_against_the_base_config():
    with pytest.raises(ValueError, match=r"imgsz = 65 is not a valid value \(imgsz must be a multiple of yolov8n's "
                                         r"largest stride, 32"):
        SearchSpace.from_dict({"imgsz": {"low": 64, "high": 128}}).check(TrainConfig())
    with pytest.raises(ValueError, match="model = 'yolov9' is not a valid value"):
        SearchSpace.from_dict({"model": {"choices": ["yolov8n", "yolov9"]}}).check(TrainConfig())
    with pytest.raises(ValueError, match="varies lr0 and momentum, but optimizer auto sets its own learning rate"):
        SearchSpace.from_dict({"lr0": {"low": 1e-3, "high": 0.1}, "momentum": {"low": 0.8, "high": 0.9}}).check(
            TrainConfig())
    SearchSpace.from_dict({"lr0": {"low": 1e-3, "high": 0.1}}).check(TrainConfig(optimizer="AdamW"))


def test_a_bad_space_or_storage_is_one_line_and_exit_2_from_the_command(tmp_path, capsys):
    from yolokit.cli import main

    (tmp_path / "space.yaml").write_text("lr0: [0.001, 0.1]\n")
    assert main(["tune", "--space", str(tmp_path / "space.yaml"), "--out", str(tmp_path / "study")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"yolokit tune: error: {tmp_path}/space.yaml: "
                                                                       "lr0: give a range")
    assert main(["tune", "--space", str(tmp_path / "space.yaml"), "--storage", "nodb://x/y"]) == 2
    assert "yolokit tune: error: --storage nodb://x/y: cannot open the study's storage (" in capsys.readouterr().err
    assert main(["tune", "--storage", str(tmp_path / "empty.journal"), "--study", "nothing"]) == 2
    assert "study 'nothing' is not in the storage: give a search space to start it" in capsys.readouterr().err


# --- pruning, trackers, joining ---------------------------------------------------------------------------------

class Closing(Tracker):
    """A tracker that records how its run was closed."""

    name = "probe"

    def start(self, config):
        self.closed = None

    def close(self, status):
        self.closed = status


def test_a_run_stopped_on_purpose_closes_its_tracker_runs_as_interrupted(tmp_path):
    tracker = Closing(tmp_path)
    tracker.on_train_start(tmp_path, {})
    pruned = optuna.TrialPruned("pruned after epoch 1")
    pruned.run_status = "interrupted"
    with pytest.raises(optuna.TrialPruned):
        try:
            raise pruned
        finally:
            tracker.on_train_end()                     # as the trainer calls it, while the exception propagates
    assert tracker.closed == "interrupted"
    tracker = Closing(tmp_path)
    tracker.on_train_start(tmp_path, {})
    with pytest.raises(RuntimeError):
        try:
            raise RuntimeError("a bug")
        finally:
            tracker.on_train_end()
    assert tracker.closed == "failed"


@pytest.mark.slow
def test_the_pruner_reads_each_epochs_metric_and_a_worker_joins_by_name(shapes, tmp_path, clean_env):
    """Trial 0 is pruned after its first epoch (the threshold is below any loss), at the value results.csv holds;
    a second call with only the storage and the study's name runs trial 1 from the study's own space and config."""
    out = tmp_path / "study"
    result = yolokit.tune(SPACE, base_config(shapes), trials=1, out=out, metric="train/box",
                          pruner=optuna.pruners.ThresholdPruner(upper=0.0))
    (trial,) = result.trials
    rows = list(csv.DictReader((out / "trial_0" / "results.csv").open()))
    assert trial["state"] == "PRUNED" and len(rows) == 1                     # stopped after epoch 1 of 2
    made = optuna.load_study(study_name="study", storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(out / "study.journal"))))
    assert list(made.trials[0].intermediate_values) == [1]
    assert math.isclose(made.trials[0].intermediate_values[1], float(rows[0]["train/box"]), rel_tol=1e-5)
    assert trial["value"] == made.trials[0].intermediate_values[1] and result.best is None
    weights = out / "trial_0" / "weights"
    assert (weights / "last.pt").is_file() and not (weights / "model.pt").exists()

    joined = yolokit.tune(storage=str(out / "study.journal"), study="study", trials=2, out=out, pruner="none",
                          keep_weights=1)
    assert [t["state"] for t in joined.trials] == ["PRUNED", "COMPLETE"]
    assert not list(weights.glob("*.pt")) and (out / "trial_0" / "results.csv").is_file()   # only the best kept
    assert {p.name for p in (out / "trial_1" / "weights").glob("*.pt")} >= {"last.pt", "model.pt", "best.pt"}
    second = TrainConfig.from_yaml(out / "trial_1" / "config.yaml")
    assert second.replace(**joined.trials[1]["params"], out="x") == base_config(shapes, model="yolov8n").replace(
        **joined.trials[1]["params"], out="x")                              # the study's base config, its params
    rows = list(csv.DictReader((out / "trial_1" / "results.csv").open()))
    assert math.isclose(joined.trials[1]["value"], min(float(r["train/box"]) for r in rows), rel_tol=1e-5)
    assert joined.best["number"] == 1 and joined.best_config == out / "best.yaml"
    with pytest.raises(ValueError, match=r"study 'study' trains with another config: epochs 2 there, 3 here"):
        yolokit.tune(storage=str(out / "study.journal"), study="study", trials=3, out=out,
                     config={"epochs": 3, "device": "cpu"})


# --- a study through the command: 2 workers, Ctrl-C, resume, the best retrained -------------------------------

def states(out: Path) -> list[tuple[int, str, float | None, dict, dict]]:
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(out / "study.journal")))
    made = optuna.load_study(study_name=out.name, storage=storage)
    return [(t.number, t.state.name, t.value, t.params, t.user_attrs) for t in made.trials]


def checkpointed(log: str, before: int) -> list[Path]:
    """The run folders of the trials under way (started, not ended) that hold a last.pt and have fewer than
    ``before`` epochs in their results.csv (so at least one whole epoch is still to come), from the sweep's log."""
    started = dict(re.findall(r"^trial (\d+)(?: \(continuing trial \d+\))?: .* -> (.+)$", log, re.M))
    ended = set(re.findall(r"^trial (\d+): (?!.* -> )", log, re.M))

    def epochs(run: Path) -> int:
        return len((run / "results.csv").read_text().splitlines()[1:]) if (run / "results.csv").is_file() else 0
    return [Path(d) for n, d in started.items()
            if n not in ended and (Path(d) / "weights" / "last.pt").is_file() and epochs(Path(d)) < before]


class Best(Callback):
    def __init__(self, metric):
        self.metric, self.values = metric, []

    def on_epoch_end(self, row):
        self.values.append(row[self.metric])


@pytest.mark.slow
@pytest.mark.extended   # four trials on two processes, Ctrl-C and resume (28 s); the default run covers a worker
# joining a study by name (the pruner's test above) and a run's Ctrl-C and resume (tests/test_interrupts.py)
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_two_workers_stopped_by_ctrl_c_resume_and_the_best_retrains_bit_for_bit(shapes, tmp_path, clean_env):
    out = tmp_path / "sweep"
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(SPACE))
    cmd = [sys.executable, "-m", "yolokit", "tune", "--space", str(tmp_path / "space.yaml"), "--trials", "4",
           "--parallel", "2", "--out", str(out), "--data", shapes, "--imgsz", "64", "--batch", "8", "--nbs", "8",
           "--epochs", "3", "--workers", "0", "--no-plots", "--warmup-epochs", "0", "--close-mosaic", "1",
           "--optimizer", "SGD", "--mosaic-buffer", "0", "--metric", "train/box", "--save-period-iters", "1"]
    env = {**subprocess_env(), "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "first.txt"
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=tmp_path, env=env,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (": finished, best" in log.read_text() and checkpointed(log.read_text(), before=2)):
            # one trial done, and one under way with a last.pt to continue from (a step's, from save_period_iters)
            # and its last epoch still to come: Ctrl-C. A trial two steps from its end could finish before the
            # signal reaches it (CI saw that), which would leave nothing to continue.
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        family = descendants(proc.pid) | {proc.pid}
        os.killpg(proc.pid, signal.SIGINT)                            # as a terminal sends it
        code = proc.wait(timeout=120)
        family |= descendants(proc.pid)
        deadline = time.monotonic() + 15
        while alive(family) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(family), f"left running: {alive(family)}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    assert code == 130 and "Traceback" not in text, text[-3000:]
    assert text.count("study 'sweep' stopped: ") == 1 and "run the same command again to resume" in text
    before = states(out)
    finished = {n: (v, p) for n, s, v, p, _ in before if s in ("COMPLETE", "PRUNED")}
    stopped = [n for n, s, *_ in before if s == "FAIL"]
    assert finished and stopped and all(s != "RUNNING" for _, s, *_ in before), before
    kept = {n: (out / f"trial_{n}" / "results.csv").read_bytes() for n in finished}

    again = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    after = states(out)
    done = [(n, s, v, p, a) for n, s, v, p, a in after if s in ("COMPLETE", "PRUNED")]
    assert len(done) == 4, after                                      # every trial finished or was pruned
    for n, (value, params) in finished.items():                       # nothing finished was lost or redone
        assert (after[n][1], after[n][2], after[n][3]) == (before[n][1], value, params)
        assert (out / f"trial_{n}" / "results.csv").read_bytes() == kept[n]
    for *_, p, a in after:
        if "resumes" in a:                                            # a stopped trial, continued where it stopped
            assert a["resumes"] in stopped and p == after[a["resumes"]][3]
            if (Path(after[a["resumes"]][4]["run_dir"]) / "weights" / "last.pt").is_file():
                assert a["run_dir"] == after[a["resumes"]][4]["run_dir"]
    assert {a.get("resumes") for *_, a in after} >= set(stopped)
    continued = [a for *_, a in done if "resumes" in a and a["run_dir"] == after[a["resumes"]][4]["run_dir"]]
    assert continued and "(continuing trial " in again.stdout         # from its checkpoint, in its folder
    for _, state, _, _, a in done:
        rows = list(csv.DictReader((Path(a["run_dir"]) / "results.csv").open()))
        assert [r["epoch"] for r in rows] == (["1", "2", "3"] if state == "COMPLETE"
                                              else ["1", "2", "3"][:len(rows)])
    table = again.stdout
    assert all(a["run_dir"] in table for *_, a in done) and "study 'sweep'" in table
    trials_csv = list(csv.DictReader((out / "trials.csv").open()))
    assert len(trials_csv) == len(after)

    # the best config retrains to the study's value bit for bit (on the CPU, with the trial's thread count)
    best = min((t for t in done if t[1] == "COMPLETE"), key=lambda t: t[2])
    assert f"best: trial {best[0]}, train/box " in table
    config = TrainConfig.from_yaml(out / "best.yaml", out=str(tmp_path / "retrained"))
    assert config.replace(out="x") == TrainConfig.from_yaml(Path(best[4]["run_dir"]) / "config.yaml", out="x",
                                                             resume=None)
    threads = torch.get_num_threads()
    torch.set_num_threads(best[4]["threads"])
    try:
        recorder = Best("train/box")
        Trainer(config, callbacks=[recorder]).fit()
    finally:
        torch.set_num_threads(threads)
    assert min(recorder.values) == best[2]                            # exactly: no tolerance
    ours = torch.load(tmp_path / "retrained" / "weights" / "model.pt", weights_only=True)["state_dict"]
    theirs = torch.load(Path(best[4]["run_dir"]) / "weights" / "model.pt", weights_only=True)["state_dict"]
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    rows = [list(csv.DictReader((run / "results.csv").open())) for run in (tmp_path / "retrained",
                                                                           Path(best[4]["run_dir"]))]
    for row in rows:
        for r in row:
            del r["seconds"], r["data%"]
    assert rows[0] == rows[1]                                         # losses, mAP50-95, mAP50, P, R, every epoch
