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
run folder. A tracker that cannot start (its library missing or broken, a bad URI, a store
it cannot open, a server that does not answer, a refused login) raises one
:class:`TrackerError` line that names where it tried to write and what to install or set;
the command line prints it and exits 2. Where they write:

- ``wandb``: project ``$WANDB_PROJECT`` or "yolokit", run name = the run folder's name, files
  under ``<run>/wandb``; ``WANDB_MODE=offline`` works without an account.
- ``mlflow``: ``$MLFLOW_TRACKING_URI`` (a server ``http://host:5000``, a SQL store
  ``sqlite:///mlflow.db``, ``databricks``, ...), else, as MLflow itself defaults, a SQLite store
  ``<out's parent>/mlflow.db`` shared by the runs next to this one, artifacts in
  ``<out's parent>/mlartifacts`` (``mlflow ui --backend-store-uri sqlite:///runs/mlflow.db``); a
  ``<out's parent>/mlruns`` file store that earlier runs filled is used on (MLflow 3 refuses file
  stores unless ``MLFLOW_ALLOW_FILE_STORE`` is set; yolokit sets it for that folder only).
  Experiment ``$MLFLOW_EXPERIMENT_ID``, else ``$MLFLOW_EXPERIMENT_NAME``, else "yolokit".
- ``tensorboard``: ``<run>/tensorboard`` (``tensorboard --logdir runs``); charts as images.
- ``csv``: ``<run>/steps.csv``, one row per logged step (``results.csv`` is always written).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from yolokit.train.callbacks import Callback, CSVLogger, Plotter, ProgressBar
from yolokit.train.trackers.base import Tracker, _require

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
                  user: list[Callback], verbose: bool = True) -> list[Callback]:
    """A run's callbacks, in order. Rank 0: the console, ``results.csv``, the charts, the trackers,
    then the user's. Other ranks: only the user's that set ``all_ranks = True``."""
    if not main:
        return [cb for cb in user if getattr(cb, "all_ranks", False)]
    built: list[Callback] = [ProgressBar(verbose=verbose), CSVLogger(run_dir / "results.csv")]
    if plots:
        built.append(Plotter(run_dir))               # before the trackers: they send its charts
    return built + build_trackers(tracker_names(trackers), run_dir) + list(user)


def build_trackers(names: list[str], run_dir: Path) -> list[Tracker]:
    """The trackers ``names`` asks for, each importing its library now (errors name the extra)."""
    from yolokit.train.trackers.mlflow_tracker import MLflowTracker

    kinds = {"wandb": WandbTracker, "mlflow": MLflowTracker, "tensorboard": TensorBoardTracker, "csv": CSVTracker}
    return [kinds[name](run_dir) for name in names]


def check_trackers(names: list[str], run_dir: Path) -> None:
    """Opens each tracker's store once, without starting a run: an error is the :class:`TrackerError`
    (or ``ImportError``) a run's start would raise. Processes that then start runs at the same time
    (the trials of a sweep) find MLflow's database and experiment made."""
    for tracker in build_trackers(names, run_dir):
        tracker.run_dir = Path(run_dir)
        tracker.guarded(tracker.open)


class WandbTracker(Tracker):
    """Weights & Biases: config, step and epoch metrics, charts as images, weights as a model artifact."""

    name = "wandb"

    def __init__(self, run_dir: Path):
        super().__init__(run_dir)
        self.wandb, self.run = _require("wandb"), None

    def start(self, config: dict[str, Any]) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        run_id = self.saved_id()
        self.run = self.wandb.init(project=os.environ.get("WANDB_PROJECT", "yolokit"), name=self.run_dir.name,
                                   dir=str(self.run_dir), config=config, id=run_id, resume="allow" if run_id else None)
        self.save_id(self.run.id)

    def where(self) -> str:
        if os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled"):
            return f"{self.run_dir / 'wandb'} (WANDB_MODE={os.environ['WANDB_MODE']})"
        return os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")

    def advice(self, exc: Exception) -> str:
        return ("log in with `wandb login` or set WANDB_API_KEY (WANDB_BASE_URL for a W&B server of your own); "
                "to log to files only, without an account, set WANDB_MODE=offline")

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


class TensorBoardTracker(Tracker):
    """TensorBoard: config as text, step and epoch scalars, charts as images (weights stay in the run folder)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path):
        super().__init__(run_dir)
        _require("tensorboard")
        self.writer = None

    def where(self) -> str:
        return str(self.run_dir / "tensorboard")

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

    def where(self) -> str:
        return str(self.run_dir / "steps.csv")

    def start(self, config: dict[str, Any]) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(self.run_dir, os.W_OK):      # fail here, at the start, not at the first step
            raise PermissionError(f"{self.run_dir} cannot be written")
        self.steps = CSVLogger(self.run_dir / "steps.csv")

    def on_epoch_end(self, row: dict[str, float]) -> None:
        self.step = int(row.get("steps", self.step))

    def log(self, values: dict[str, float], step: int) -> None:
        self.steps.write({"step": step, **values})

    def log_files(self, charts: list[Path], weights: list[Path]) -> None:
        pass                                           # they are in the run folder already

    def close(self, status: str) -> None:
        pass
