"""Experiment trackers: Weights & Biases, MLflow, TensorBoard and a CSV of steps.

``TrainConfig.tracker`` (``--tracker wandb,mlflow``) names them; each is a
:class:`~yolokit.train.callbacks.Callback` built on rank 0 only, and imports its library
when the run starts (a missing one is an error naming the extra to install). Each logs:

- the resolved config (``on_train_start``);
- per-step losses and the learning rate at the loss meter's read points (``on_log``):
  ``step/box``, ``step/cls``, ``step/dfl`` (the mean of rank 0's batches since the previous
  point) and ``step/lr``, against the optimizer step;
- each epoch's results row (``on_epoch_end``): losses over every process, precision,
  recall, mAP50, mAP50-95, fitness, lr, seconds and ``data%`` (named ``data_pct``), against
  the optimizer step at the epoch's end;
- when the run finished (``on_export`` came): the charts and the weights, ``best.pt`` and
  ``model.pt`` (``on_train_end``, after the charts are drawn), and closes the run as
  finished, interrupted or failed.

A resumed run continues the same tracker run: the ids are kept in ``trackers.json`` in the
run folder. Where they write:

- ``wandb``: project ``$WANDB_PROJECT`` or "yolokit", run name = the run folder's name, files
  under ``<run>/wandb``; ``WANDB_MODE=offline`` works without an account.
- ``mlflow``: ``$MLFLOW_TRACKING_URI``, else a file store ``<out's parent>/mlruns`` shared by
  the runs next to this one (``mlflow ui --backend-store-uri runs/mlruns``); experiment
  ``$MLFLOW_EXPERIMENT_NAME`` or "yolokit". MLflow 3 refuses a file store unless
  ``MLFLOW_ALLOW_FILE_STORE`` is set; yolokit sets it for its own default store only.
- ``tensorboard``: ``<run>/tensorboard`` (``tensorboard --logdir runs``); charts as images.
- ``csv``: ``<run>/steps.csv``, one row per logged step (``results.csv`` is always written).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any

from yolokit.train.callbacks import Callback, CSVLogger, Plotter, ProgressBar

TRACKERS = ("wandb", "mlflow", "tensorboard", "csv")   # each library tracker's pip extra has its name


def tracker_names(value: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """``"wandb,mlflow"`` (or a list) as a list of known tracker names; unknown ones are an error."""
    if value is None:
        return []
    items = value.replace(" ", ",").split(",") if isinstance(value, str) else [str(v) for v in value]
    names = [n.strip().lower() for n in items if n.strip() and n.strip().lower() != "none"]
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(f"unknown tracker {', '.join(map(repr, unknown))}; available: {', '.join(TRACKERS)}")
    return list(dict.fromkeys(names))


def run_callbacks(run_dir: Path, *, main: bool, plots: bool, trackers: list[str] | None,
                  user: list[Callback]) -> list[Callback]:
    """A run's callbacks, in order. Rank 0: the console, ``results.csv``, the charts, the trackers,
    then the user's. Other ranks: only the user's that set ``all_ranks = True``."""
    if not main:
        return [cb for cb in user if getattr(cb, "all_ranks", False)]
    built: list[Callback] = [ProgressBar(), CSVLogger(run_dir / "results.csv")]
    if plots:
        built.append(Plotter(run_dir))               # before the trackers: they send its charts
    return built + build_trackers(tracker_names(trackers), run_dir) + list(user)


def build_trackers(names: list[str], run_dir: Path) -> list[Callback]:
    """The trackers ``names`` asks for, each importing its library now (errors name the extra)."""
    kinds = {"wandb": WandbTracker, "mlflow": MLflowTracker, "tensorboard": TensorBoardTracker, "csv": CSVTracker}
    return [kinds[name](run_dir) for name in names]


class TrackerError(RuntimeError):
    """A tracker could not start its run (no login, an unreachable server, ...)."""


def _require(name: str) -> Any:
    """The tracker library ``name``, imported now; missing, an error naming its extra."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(f"--tracker {name} needs the {name} package: pip install 'yolokit[{name}]' "
                          f"(or pip install {name}); {exc}") from None


def metric_name(key: str) -> str:
    """A results-row key as every tracker accepts it (MLflow allows no ``%``)."""
    return key.replace("%", "_pct")


def numeric(values: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of ``values``, under tracker-safe names."""
    return {metric_name(k): float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{"augment.hsv_h": 0.015, ...}`` (for trackers with flat parameters)."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flat_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class Tracker(Callback):
    """What every tracker shares: the run's ids across resume, the final files, how the run ended.

    Subclasses implement ``start(config)``, ``log(values, step)``, ``log_files(charts, weights)`` and
    ``close(status)`` (status: "finished", "interrupted" or "failed").
    """

    name = "tracker"

    def __init__(self, run_dir: Path):
        self.run_dir, self.exported, self.status, self.step = Path(run_dir), None, "failed", 0
        self.broken = False                                     # failed once: left out (see _safely)

    # ids of the tracker runs, so a resumed training run logs into the same one
    def saved_id(self) -> str | None:
        path = self.run_dir / "trackers.json"
        return json.loads(path.read_text()).get(self.name) if path.is_file() else None

    def save_id(self, run_id: str) -> None:
        path = self.run_dir / "trackers.json"
        ids = json.loads(path.read_text()) if path.is_file() else {}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**ids, self.name: run_id}, indent=1))

    def on_train_start(self, run_dir: Path, config: dict[str, Any]) -> None:
        self.run_dir = Path(run_dir)
        self.start(config)

    def _safely(self, what: str, action: Any, *args: Any) -> None:
        """A tracker that fails mid-run (a server gone, a full disk) is warned about once and left
        out from then on: it never costs the run its training."""
        if self.broken:
            return
        try:
            action(*args)
        except Exception as exc:
            self.broken = True
            warnings.warn(f"--tracker {self.name} failed to {what} ({type(exc).__name__}: {exc}); training goes on "
                          f"without it (results.csv and the run folder have everything)", RuntimeWarning, stacklevel=2)

    def on_log(self, step: int, values: dict[str, float]) -> None:
        self.step = step
        self._safely("log a step", self.log, numeric(values), step)

    def on_epoch_end(self, row: dict[str, float]) -> None:
        self.step = int(row.get("steps", self.step))
        self._safely("log an epoch", self.log, numeric(row), self.step)

    def on_interrupt(self, steps: int, run_dir: Path) -> None:
        self.status = "interrupted"

    def on_export(self, weights: Path) -> None:
        self.exported, self.status = Path(weights), "finished"

    def on_train_end(self) -> None:
        if self.exported is not None:
            charts = sorted(p for p in [*self.run_dir.glob("*.png"), *self.run_dir.glob("*.jpg")] if p.is_file())
            weights = [p for p in (self.run_dir / "weights" / "best.pt", self.exported) if p.is_file()]
            self._safely("send the final files", self.log_files, charts, weights)
        self.broken = False                                     # closing is worth a try in any case
        self._safely("close its run", self.close, self.status)

    def start(self, config: dict[str, Any]) -> None:
        raise NotImplementedError

    def log(self, values: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def log_files(self, charts: list[Path], weights: list[Path]) -> None:
        raise NotImplementedError

    def close(self, status: str) -> None:
        raise NotImplementedError


class WandbTracker(Tracker):
    """Weights & Biases: config, step and epoch metrics, charts as images, weights as a model artifact."""

    name = "wandb"

    def __init__(self, run_dir: Path):
        super().__init__(run_dir)
        self.wandb, self.run = _require("wandb"), None

    def start(self, config: dict[str, Any]) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        run_id = self.saved_id()
        try:
            self.run = self.wandb.init(project=os.environ.get("WANDB_PROJECT", "yolokit"), name=self.run_dir.name,
                                       dir=str(self.run_dir), config=config, id=run_id,
                                       resume="allow" if run_id else None)
        except Exception as exc:
            raise TrackerError(f"--tracker wandb could not start a run ({exc}); to log to files only, without "
                               "an account, set WANDB_MODE=offline") from exc
        self.save_id(self.run.id)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def log_files(self, charts: list[Path], weights: list[Path]) -> None:
        if charts:
            self.run.log({f"charts/{p.stem}": self.wandb.Image(str(p)) for p in charts}, step=self.step)
        if weights:
            artifact = self.wandb.Artifact(f"{self.run_dir.name}-weights", type="model")
            for path in weights:
                artifact.add_file(str(path), name=path.name)
            self.run.log_artifact(artifact)

    def close(self, status: str) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if status == "finished" else 1)
            self.run = None


class MLflowTracker(Tracker):
    """MLflow: config as parameters, step and epoch metrics, charts and weights as artifacts."""

    name = "mlflow"

    def __init__(self, run_dir: Path):
        super().__init__(run_dir)
        self.mlflow, self.client, self.run_id = _require("mlflow"), None, None

    def start(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Metric, Param

        self.metric = Metric
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:                                  # the default: a file store next to the runs
            uri = (self.run_dir.parent.resolve() / "mlruns").as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = self.mlflow.MlflowClient(uri)
        self.run_id = self.saved_id()
        if self.run_id is None:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "yolokit")
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
            self.run_id = self.client.create_run(experiment_id, run_name=self.run_dir.name).info.run_id
            self.save_id(self.run_id)
            params = [Param(k, str(v)) for k, v in flat_config(config).items()]
            for i in range(0, len(params), 100):     # MLflow takes at most 100 parameters per call
                self.client.log_batch(self.run_id, params=params[i:i + 100])
        else:
            self.client.update_run(self.run_id, status="RUNNING")

    def log(self, values: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self.metric(k, v, now, step) for k, v in values.items()])

    def log_files(self, charts: list[Path], weights: list[Path]) -> None:
        for path in charts:
            self.client.log_artifact(self.run_id, str(path), artifact_path="charts")
        for path in weights:
            self.client.log_artifact(self.run_id, str(path), artifact_path="weights")

    def close(self, status: str) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id, {"finished": "FINISHED", "interrupted": "KILLED"}.get(
                status, "FAILED"))
            self.client = None


class TensorBoardTracker(Tracker):
    """TensorBoard: config as text, step and epoch scalars, charts as images (weights stay in the run folder)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path):
        super().__init__(run_dir)
        _require("tensorboard")
        self.writer = None

    def start(self, config: dict[str, Any]) -> None:
        import yaml
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.run_dir / "tensorboard"))
        self.writer.add_text("config", "```\n" + yaml.safe_dump(config, sort_keys=False) + "```", 0)

    def log(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def log_files(self, charts: list[Path], weights: list[Path]) -> None:
        import cv2

        for path in charts:
            image = cv2.imread(str(path), cv2.IMREAD_COLOR)
            if image is not None:
                self.writer.add_image(f"charts/{path.stem}", image[..., ::-1].copy(), self.step, dataformats="HWC")
        self.writer.add_text("weights", "\n\n".join(str(p) for p in weights), self.step)

    def close(self, status: str) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class CSVTracker(Tracker):
    """``steps.csv``: a row per logged step, the per-step losses and learning rate (epoch rows are
    results.csv's)."""

    name = "csv"

    def start(self, config: dict[str, Any]) -> None:
        self.steps = CSVLogger(self.run_dir / "steps.csv")

    def on_epoch_end(self, row: dict[str, float]) -> None:
        self.step = int(row.get("steps", self.step))

    def log(self, values: dict[str, float], step: int) -> None:
        self.steps.write({"step": step, **values})

    def log_files(self, charts: list[Path], weights: list[Path]) -> None:
        pass                                           # they are in the run folder already

    def close(self, status: str) -> None:
        pass
