"""Hyperparameter sweeps: an Optuna study whose trials are full yolokit training runs.

``tune(space, config, trials=20, parallel=2)`` (``yolokit tune``) samples the fields a search
space names (:mod:`yolokit.train.sweeps.space`) onto a base ``TrainConfig`` and trains each trial as
an ordinary run: its own folder ``<out>/trial_<n>`` (``results.csv``, weights, charts) and its
own tracker run (MLflow experiment and W&B group = the study's name unless set). A callback
reports each epoch's metric (``mAP50-95`` by default) to the study, whose pruner (median by
default) may stop a trial that lags; a trial's value is the best of its epochs.

Why Optuna, not Ray Tune: pure Python (no cluster to start, no binary wheels beyond what
yolokit has), and a study lives in plain storage that any number of processes and machines
share: a journal file (the default, ``<out>/study.journal``; on a shared filesystem for
several machines) or any SQL database (``postgresql://``, ``mysql://``, ``sqlite:///``). A
worker joins with the storage and the study's name; it reads the space and the base config
from the study. Trials then run at once in several processes on one machine (``parallel``,
started by :func:`yolokit.accel.launcher.launch`: Ctrl-C reaches each once; with several GPUs
and ``device`` auto, process i trains on GPU i mod their number) and on other machines
running the same command.

Ctrl-C stops every trial at an optimizer step (saved, as any run), and the study keeps every
finished trial. Running the same command again resumes: each interrupted trial continues from
its checkpoint (its folder, tracker run and earlier epochs' reports), then new trials run
until ``trials`` have finished (completed or pruned). The study ends with ``trials.csv``,
``best.yaml`` (the best trial's config as a TrainConfig YAML, ready for ``yolokit train
--config``) and the trials side by side (:func:`yolokit.train.compare_runs`).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from yolokit.accel import TrainingDiverged
from yolokit.accel.launcher import launch
from yolokit.accel.stop import GracefulStop, Interrupted
from yolokit.train.callbacks import Callback
from yolokit.train.config import TrainConfig
from yolokit.train.sweeps.space import SearchSpace
from yolokit.train.sweeps.study import (
    MAXIMIZED,
    MINIMIZED,
    TuneResult,
    enqueue_stopped,
    fail_stale,
    open_storage,
    open_study,
    pruner_of,
    require_optuna,
    study_config,
    summarize,
    trial_counts,
    trial_of,
)
from yolokit.train.trackers.base import TrackerError, one_line
from yolokit.train.trackers.catalog import check_trackers
from yolokit.train.trainer import Trainer

LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
MENDABLE = (FileNotFoundError, ValueError, ImportError, TrackerError)   # bad input: one line, not a traceback


class Reporter(Callback):
    """Reports each epoch's ``metric`` to the trial and stops the run (an ``optuna.TrialPruned`` that
    trackers close as interrupted) when the study's pruner says so."""

    def __init__(self, trial: Any, metric: str, maximize: bool, earlier: dict[int, float] | None = None):
        self.trial, self.metric, self.maximize = trial, metric, maximize
        self.values: dict[int, float] = dict(earlier or {})

    def on_epoch_end(self, row: dict[str, float]) -> None:
        epoch, value = int(row["epoch"]), float(row[self.metric])
        self.values[epoch] = value
        self.trial.report(value, epoch)
        if self.trial.should_prune():
            stop = require_optuna().TrialPruned(f"pruned after epoch {epoch}: {self.metric} {value:.4f}")
            stop.run_status = "interrupted"
            raise stop

    @property
    def best(self) -> float:
        return (max if self.maximize else min)(self.values.values())


def tune(space: str | Path | dict | SearchSpace | None = None, config: TrainConfig | dict | None = None, *,
         trials: int = 10, parallel: int = 1, storage: str | None = None, study: str | None = None,
         metric: str | None = None, pruner: str | Any | None = None, out: str | Path = "runs/tune",
         keep_weights: int | None = None) -> TuneResult:
    """Runs (or resumes, or joins) a study until ``trials`` trials have finished; returns its outcome.

    Args:
        space: the search space (a YAML path, a dict or a :class:`SearchSpace`); None: the study's own
            (a worker joining a study made elsewhere).
        config: the base config every trial starts from, or a dict of the fields to set on the defaults;
            None: the study's own. A study that exists keeps its config: a field given otherwise is an
            error, except those a machine sets for itself (device, workers, cache, plots, tracker).
        trials: finished trials (completed or pruned) the study should reach.
        parallel: trials trained at once on this machine, each in its own process.
        storage: a SQL database URL or a journal file path; default ``<out>/study.journal``.
        study: the study's name; default the name of ``out``.
        metric: the results.csv column a new study optimizes (default mAP50-95; mAP50, fitness, precision,
            recall: maximized; train/box, train/cls, train/dfl: minimized), per epoch for the pruner.
        pruner: "median" (a new study's default), "hyperband", "none", or an Optuna pruner; None: the
            study's own (by name).
        out: the study's folder: trial run folders, trials.csv, best.yaml.
        keep_weights: when the study has its trials, only the best this many finished trials keep their
            weights files (the others keep results.csv, config and charts); None: every trial keeps them.
    """
    optuna, out = require_optuna(), Path(out)
    if metric is not None and metric not in MAXIMIZED + MINIMIZED:
        raise ValueError(f"metric must be one of {', '.join(MAXIMIZED + MINIMIZED)}, got {metric!r}")
    if trials < 1 or parallel < 1:
        raise ValueError(f"trials and parallel must be >= 1, got {trials} and {parallel}")
    if keep_weights is not None and keep_weights < 0:
        raise ValueError(f"keep_weights must be >= 0, got {keep_weights}")
    storage, name = storage or str(out / "study.journal"), study or out.name
    made = open_study(optuna, open_storage(storage), name, space, config, metric,
                      pruner if pruner is None or isinstance(pruner, str) else type(pruner).__name__)
    base, metric = study_config(made, config), made.user_attrs["metric"]
    pruner = pruner if pruner is not None else made.user_attrs["pruner"]
    pruner_of(pruner, base.epochs)                             # a bad name: now
    fail_stale(made)
    enqueue_stopped(made)
    counts = trial_counts(made)
    left = trials - counts["finished"] - counts["running"]
    with _study_env(name):
        check_trackers(base.tracker or [], out / "trial")      # a tracker that cannot start: now, not in a worker
        if left > 0:
            _run_workers(made, dict(storage=storage, study=name, out=str(out), trials=trials, base=base.to_dict(),
                                    pruner=pruner), left, parallel)
    return summarize(made, out, storage, metric, keep_weights)


@contextlib.contextmanager
def _study_env(name: str) -> Iterator[None]:
    """The trials' tracker runs group under the study's name (MLflow experiment, W&B group) unless set."""
    saved = {k: os.environ.get(k) for k in ("MLFLOW_EXPERIMENT_NAME", "WANDB_RUN_GROUP")}
    os.environ.update({k: name for k, v in saved.items() if v is None})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)


def _run_workers(made: Any, settings: dict[str, Any], left: int, parallel: int) -> None:
    """``left`` more trials over ``parallel`` processes (this one alone when 1); Ctrl-C: one line, re-raised."""
    quotas = [left // parallel + (i < left % parallel) for i in range(min(parallel, left))]
    settings = {**settings, "quotas": quotas, "launched": len(quotas) > 1}
    try:
        for outcome in launch(_worker, len(quotas), settings):
            if isinstance(outcome, BaseException):             # a worker's bad input: raised here as itself
                raise outcome
    except KeyboardInterrupt as exc:
        stop = Interrupted.of(exc)
        print(f"study {made.study_name!r} stopped: {trial_counts(made)['finished']} of {settings['trials']} trials "
              f"finished and kept in {settings['storage']}; run the same command again to resume (interrupted "
              "trials continue from their checkpoints)", flush=True)
        stop.reported = True
        raise stop from None


def _worker(settings: dict[str, Any]) -> int | BaseException:
    """One process's trials: until its quota is done or the study has enough (bad input is returned, launched)."""
    index = int(os.environ.get("LOCAL_RANK", "0"))
    if settings["launched"]:                   # launch() made this process a rank; each trial here trains alone
        for key in LAUNCH_VARS:
            os.environ.pop(key, None)
    try:
        return _trials(settings, index)
    except MENDABLE as exc:
        if not settings["launched"]:
            raise
        return exc


def _trials(settings: dict[str, Any], index: int) -> int:
    optuna = require_optuna()
    handle = open_storage(settings["storage"])
    known = len(optuna.load_study(study_name=settings["study"], storage=handle).trials)
    base = TrainConfig.from_dict(settings["base"])
    gpus = torch.cuda.device_count() if settings["launched"] and base.device in ("auto", "cuda") else 0
    if gpus > 1:                               # several GPUs here: worker i trains on GPU i mod their number
        base = base.replace(device=f"cuda:{index % gpus}")
    seed = int(np.random.SeedSequence([base.seed, index, known]).generate_state(1)[0])   # apart per worker and run
    made = optuna.load_study(study_name=settings["study"], storage=handle, sampler=optuna.samplers.TPESampler(
        seed=seed), pruner=pruner_of(settings["pruner"], base.epochs))
    done = 0
    with GracefulStop() as stop:
        while done < settings["quotas"][index] and sum(trial_counts(made).values()) < settings["trials"]:
            run_trial(made, base, Path(settings["out"]), stop)
            done += 1
    return done


def run_trial(made: Any, base: TrainConfig, out: Path, stop: GracefulStop) -> None:
    """Asks the study for a trial, trains it as a yolokit run and tells the study how it went."""
    optuna = require_optuna()
    states = optuna.trial.TrialState
    space, metric = SearchSpace.from_dict(made.user_attrs["space"]), made.user_attrs["metric"]
    trial = None
    try:
        with stop.deferred():                  # asked and described at once: a signal acts after this section
            trial = made.ask()
            params = space.suggest(trial)
            old = trial_of(made, trial.user_attrs.get("resumes"))
            resume = old is not None and (Path(old.user_attrs["run_dir"]) / "weights" / "last.pt").is_file()
            run_dir = Path(old.user_attrs["run_dir"]) if resume else out / f"trial_{trial.number}"
            for key, value in (("run_dir", str(run_dir)), ("host", socket.gethostname()), ("pid", os.getpid()),
                               ("threads", torch.get_num_threads())):
                trial.set_user_attr(key, value)
            earlier = dict(old.intermediate_values) if resume else {}
            for epoch, value in earlier.items():
                trial.report(value, epoch)
        if not resume and (run_dir / "weights").exists():
            raise ValueError(f"{run_dir} holds a run that is not this study's trial {trial.number}: give another out")
        config = base.replace(**params, out=str(run_dir), resume=str(run_dir) if resume else None)
        print(f"trial {trial.number}{f' (continuing trial {old.number})' if resume else ''}: "
              + ", ".join(f"{k}={v}" for k, v in params.items()) + f" -> {run_dir}", flush=True)
        reporter = Reporter(trial, metric, made.direction.name == "MAXIMIZE", earlier)
        Trainer(config, callbacks=[reporter]).fit()
        _tell(made, trial, stop, value=reporter.best)   # in the try: a signal just before it stops the trial
    except optuna.TrialPruned as exc:
        _tell(made, trial, stop, state=states.PRUNED)
        print(f"trial {trial.number}: {exc}", flush=True)
    except TrainingDiverged as exc:            # a config that diverges is a bad one, not a broken study
        _tell(made, trial, stop, state=states.PRUNED, diverged=one_line(exc))
        print(f"trial {trial.number}: pruned, training diverged", flush=True)
    except KeyboardInterrupt:                  # stopped: failed without an error, so resumed by the next run
        if trial is not None:
            _tell(made, trial, stop, state=states.FAIL)
        raise
    except BaseException as exc:
        if trial is not None:
            _tell(made, trial, stop, state=states.FAIL, error=one_line(exc))
        raise
    else:
        print(f"trial {trial.number}: finished, best {metric} {reporter.best:.4f}", flush=True)


def _tell(made: Any, trial: Any, stop: GracefulStop, *, value: float | None = None, state: Any = None,
          **attrs: str) -> None:
    """The trial's end in the study, out of a signal's reach (a signal that came during it is raised after);
    a trial told already stays as it was."""
    with stop.deferred(), contextlib.suppress(require_optuna().exceptions.UpdateFinishedTrialError):
        for key, text in attrs.items():
            trial.set_user_attr(key, text)
        made.tell(trial, value, state=state, skip_if_finished=True)
