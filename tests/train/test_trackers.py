"""Experiment trackers: what W&B (offline), MLflow (a file store), TensorBoard and the CSV log
received, read back from their files and compared with results.csv; rank 0 only; resume."""

import csv
import json
import math
import struct
import sys

import pytest

from yolokit.data import make_shapes
from yolokit.train import TrainConfig, Trainer, train
from yolokit.train.callbacks import Callback
from yolokit.train.trackers.catalog import TRACKERS, build_trackers, run_callbacks, tracker_names


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):   # 20 training images: batches of 8, 8 and 4
    return str(make_shapes(tmp_path_factory.mktemp("shapes") / "set", n_train=20, n_val=8, imgsz=64))


def tiny(shapes, out, **kw):
    # batch = nbs: one loader batch per optimizer step (3 an epoch)
    base = dict(data=shapes, imgsz=64, batch=8, nbs=8, epochs=2, workers=0, out=str(out), plots=False,
                warmup_epochs=0.0, close_mosaic=1)
    return TrainConfig(**{**base, **kw})


def rows(path):
    return list(csv.DictReader(path.open()))


def close(a, b, rel=1e-4):
    return math.isclose(float(a), float(b), rel_tol=rel, abs_tol=1e-9)


# --- names, flags, rank 0 ---------------------------------------------------------------------------------

def test_tracker_names_from_flags_yaml_lists_and_errors():
    assert tracker_names("wandb,csv") == ["wandb", "csv"]
    assert tracker_names("MLflow tensorboard, mlflow") == ["mlflow", "tensorboard"]
    assert tracker_names(["csv"]) == ["csv"] and tracker_names(None) == [] and tracker_names("none") == []
    assert TrainConfig(tracker="wandb,mlflow").tracker == ["wandb", "mlflow"] and TrainConfig().tracker is None
    with pytest.raises(ValueError, match="unknown tracker 'comet'; available: wandb, mlflow, tensorboard, csv"):
        TrainConfig(tracker="comet")
    import argparse

    from yolokit.train.config import add_config_flags, config_from_args
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    assert config_from_args(parser.parse_args(["--tracker", "csv,tensorboard"])).tracker == ["csv", "tensorboard"]


def test_a_missing_library_names_the_extra(tmp_path, monkeypatch):
    for module in ("wandb", "mlflow", "tensorboard"):
        monkeypatch.setitem(sys.modules, module, None)     # as if not installed
        with pytest.raises(ImportError, match=rf"--tracker {module} needs the {module} package: "
                                              rf"pip install 'yolokit\[{module}\]'"):
            build_trackers([module], tmp_path)
    assert [type(t).__name__ for t in build_trackers(["csv"], tmp_path)] == ["CSVTracker"]   # no library
    assert set(TRACKERS) == {"wandb", "mlflow", "tensorboard", "csv"}


class Everywhere(Callback):
    all_ranks = True


def test_user_callbacks_run_on_rank_0_unless_they_say_all_ranks(tmp_path):
    mine, everywhere = Callback(), Everywhere()
    main = run_callbacks(tmp_path, main=True, plots=False, trackers=["csv"], user=[mine, everywhere])
    assert [type(c).__name__ for c in main] == ["ProgressBar", "CSVLogger", "CSVTracker", "Callback", "Everywhere"]
    other = run_callbacks(tmp_path, main=False, plots=True, trackers=["csv"], user=[mine, everywhere])
    assert other == [everywhere]     # no console, files or trackers on other ranks; only the all_ranks one


# --- what each tracker received -----------------------------------------------------------------------------

def wandb_records(run_dir):
    """The records of the offline run's transaction log (a leveldb-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, pos, block, pending, records = path.read_bytes(), 7, 32768, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (kind == 0 and length == 0):     # a block's zero padding
            pos += left
            continue
        pending, pos = pending + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):                                  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@pytest.mark.slow
def test_every_tracker_logs_config_steps_epochs_and_final_files(shapes, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = tmp_path / "runs" / "train"
    # nbs 16: 2 batches a step, so an epoch's batches 8, 8, 4 make a whole step and a partial one
    train(tiny(shapes, run, tracker="wandb,mlflow,tensorboard,csv", plots=True, nbs=16))
    results, steps = rows(run / "results.csv"), rows(run / "steps.csv")
    last_step = [int(r["steps"]) for r in results]
    assert last_step == [2, 4]

    # csv: one row per optimizer step, the mean of the batches since the last (on the CPU the meter
    # is read every batch): 2 batches, then 1; weighted so, an epoch's rows give results.csv's mean
    assert [int(r["step"]) for r in steps] == [1, 2, 3, 4]
    for epoch, row in enumerate(results):
        whole, partial = steps[2 * epoch:2 * epoch + 2]
        for part in ("box", "cls", "dfl"):
            mean = (2 * float(whole[f"step/{part}"]) + float(partial[f"step/{part}"])) / 3
            assert close(mean, row[f"train/{part}"], rel=2e-4)
        assert close(partial["step/lr"], row["lr"])

    # MLflow: the default store next to the run folder, as MLflow defaults: SQLite, artifacts in a folder beside it
    from mlflow import MlflowClient
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    ids = json.loads((run / "trackers.json").read_text())
    got = client.get_run(ids["mlflow"])
    assert got.info.status == "FINISHED" and got.info.run_name == "train"
    assert got.data.params["imgsz"] == "64" and got.data.params["augment.mosaic"] == "1.0"
    assert got.data.params["tracker"] == str(["wandb", "mlflow", "tensorboard", "csv"])
    box = client.get_metric_history(ids["mlflow"], "step/box")
    assert [m.step for m in box] == [1, 2, 3, 4]
    assert all(close(m.value, r["step/box"]) for m, r in zip(box, steps, strict=True))
    for key, name in (("mAP50-95", "mAP50-95"), ("data%", "data_pct"), ("train/box", "train/box")):
        history = client.get_metric_history(ids["mlflow"], name)
        assert [m.step for m in history] == last_step
        assert all(close(m.value, r[key]) for m, r in zip(history, results, strict=True))
    assert {a.path for a in client.list_artifacts(ids["mlflow"], "weights")} == {"weights/best.pt", "weights/model.pt"}
    assert (tmp_path / "runs" / "mlartifacts").is_dir() and not (tmp_path / "runs" / "mlruns").exists()
    assert {a.path for a in client.list_artifacts(ids["mlflow"], "charts")} >= {"charts/results.png",
                                                                               "charts/val_predictions.jpg"}

    # W&B: the offline run's log holds the config, a history row per step, the epoch rows, charts, weights
    records = wandb_records(run)
    (started,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for item in started.config.update}
    assert started.run_id == ids["wandb"] and started.display_name == "train"
    assert config["imgsz"] == 64 and config["augment"]["mosaic"] == 1.0
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history.setdefault(items["_step"], {}).update(items)
    assert [s for s in sorted(history) if "step/box" in history[s]] == [1, 2, 3, 4]
    assert all(close(history[int(r["step"])]["step/box"], r["step/box"]) for r in steps)
    for step, row in zip(last_step, results, strict=True):
        assert close(history[step]["mAP50"], row["mAP50"]) and close(history[step]["data_pct"], row["data%"])
        assert close(history[step]["train/cls"], row["train/cls"])
    assert any("charts/results/path" in h for h in history.values())
    (artifact,) = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    assert artifact.type == "model" and {c.path for c in artifact.manifest.contents} == {"best.pt", "model.pt"}
    exits = [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"]
    assert exits == [0]

    # TensorBoard: scalars per step and per epoch, the config, the charts
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0, "scalars": 0}).Reload()
    assert [e.step for e in events.Scalars("step/box")] == [1, 2, 3, 4]
    assert [e.step for e in events.Scalars("mAP50")] == last_step
    assert all(close(e.value, r["mAP50-95"]) for e, r in zip(events.Scalars("mAP50-95"), results, strict=True))
    assert "charts/results" in events.Tags()["images"]
    assert "imgsz: 64" in events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()


class StopAt(Callback):
    """Ctrl-C after optimizer step ``k``."""

    def __init__(self, k):
        self.k = k

    def on_log(self, step, values):
        if step == self.k:
            raise KeyboardInterrupt


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_tracker_run(shapes, tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    store = tmp_path / "store"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())          # the user's own store
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "fine-tune")
    config = tiny(shapes, tmp_path / "run", tracker="mlflow,csv")
    with pytest.raises(KeyboardInterrupt):
        Trainer(config, callbacks=[StopAt(4)]).fit()
    from mlflow import MlflowClient
    client = MlflowClient(store.as_uri())
    (run_id,) = {json.loads((tmp_path / "run" / "trackers.json").read_text())["mlflow"]}
    assert client.get_run(run_id).info.status == "KILLED"
    assert [m.step for m in client.get_metric_history(run_id, "step/box")] == [1, 2, 3, 4]
    train(TrainConfig(resume=str(tmp_path / "run")))
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED" and client.get_experiment(got.info.experiment_id).name == "fine-tune"
    assert len(client.search_runs([got.info.experiment_id])) == 1           # no second run
    # the interrupted step 4 was not saved (Ctrl-C stops at the last completed step: 4 was completed and saved,
    # so the resumed run goes on from step 5); every step once, in order, in both the store and steps.csv
    assert [m.step for m in client.get_metric_history(run_id, "step/box")] == [1, 2, 3, 4, 5, 6]
    assert [int(r["step"]) for r in rows(tmp_path / "run" / "steps.csv")] == [1, 2, 3, 4, 5, 6]
    assert [m.step for m in client.get_metric_history(run_id, "mAP50")] == [3, 6]


@pytest.mark.slow
def test_the_command_line_says_in_one_line_when_a_tracker_cannot_start(shapes, tmp_path, monkeypatch, capsys):
    """W&B without an account (and not offline): exit 2, one line that says what to do, no traceback."""
    pytest.importorskip("wandb")
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"), NETRC=str(tmp_path / "none"))
    done = subprocess.run([sys.executable, "-m", "yolokit", "train", "--data", shapes, "--epochs", "1", "--imgsz", "64",
                           "--workers", "0", "--tracker", "wandb", "--out", str(tmp_path / "run")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("yolokit train: error: --tracker wandb could not start "
                                                           "a run at https://api.wandb.ai (")
    assert "WANDB_MODE=offline" in done.stderr.strip().splitlines()[-1]

    from yolokit.cli import main

    monkeypatch.setitem(sys.modules, "mlflow", None)   # mlflow missing: in this process (the exit code is main's)
    capsys.readouterr()
    assert main(["train", "--data", shapes, "--tracker", "mlflow", "--out", str(tmp_path / "run2")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--tracker mlflow needs the mlflow package: pip install 'yolokit[mlflow]'" in err


def test_a_tracker_failing_mid_run_warns_once_and_training_goes_on(tmp_path):
    from yolokit.train.trackers.catalog import CSVTracker

    tracker = CSVTracker(tmp_path)
    tracker.on_train_start(tmp_path, {})
    tracker.on_log(1, {"step/box": 1.0})
    calls = []

    def gone(values, step):
        calls.append(step)
        raise ConnectionError("server gone")

    tracker.log = gone
    with pytest.warns(RuntimeWarning, match=r"--tracker csv failed to log a step \(ConnectionError: server gone\); "
                                            "training goes on without it"):
        tracker.on_log(2, {"step/box": 2.0})
    tracker.on_epoch_end({"epoch": 1, "steps": 2, "mAP50": 0.5})     # left out: no second warning, no call
    tracker.on_export(tmp_path / "model.pt")
    tracker.on_train_end()
    assert calls == [2] and [r["step"] for r in rows(tmp_path / "steps.csv")] == ["1"]
