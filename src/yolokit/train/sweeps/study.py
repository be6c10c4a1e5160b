"""A sweep's study: its storage, its books (what it searches, from which config, which trials are done or
to continue) and its outcome (``trials.csv``, ``best.yaml``, the trials side by side).

The study records its search space, base config, metric and pruner as user attributes, so a worker
that joins it (another process, another machine) needs only the storage and the study's name.
"""

from __future__ import annotations

import csv
import importlib
import math
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from yolokit.train.compare import Comparison, compare_runs
from yolokit.train.config import TrainConfig
from yolokit.train.sweeps.space import SearchSpace
from yolokit.train.trackers.base import one_line

MAXIMIZED = ("mAP50-95", "mAP50", "fitness", "precision", "recall")
MINIMIZED = ("train/box", "train/cls", "train/dfl")
RUNTIME = {"device", "workers", "cache", "plots", "tracker", "out", "resume"}   # a machine may set its own


def require_optuna() -> Any:
    """The optuna module; missing, an error naming the extra."""
    try:
        return importlib.import_module("optuna")
    except ImportError:
        raise ImportError("yolokit tune needs Optuna: pip install 'yolokit[tune]' (or pip install optuna)") from None


def open_storage(storage: str) -> Any:
    """An Optuna storage: a SQL database URL (``postgresql://``, ``mysql://``, ``sqlite:///``) or the path of a
    journal file (several processes, and machines sharing its filesystem, append to it under a lock)."""
    optuna = require_optuna()
    try:
        if "://" in storage:
            connect = {"connect_args": {"timeout": 60}} if storage.startswith("sqlite") else {}
            return optuna.storages.RDBStorage(storage, engine_kwargs=connect)
        Path(storage).parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(storage)))
    except Exception as exc:
        raise ValueError(f"--storage {storage}: cannot open the study's storage ({one_line(exc)})") from None


def pruner_of(name: str | Any, epochs: int) -> Any:
    """``"median"`` (Optuna's MedianPruner), ``"hyperband"`` (up to ``epochs``), ``"none"``, or a pruner."""
    if not isinstance(name, str):
        return name
    pruners = require_optuna().pruners
    kinds = {"median": pruners.MedianPruner, "none": pruners.NopPruner,
             "hyperband": lambda: pruners.HyperbandPruner(min_resource=1, max_resource=epochs)}
    if name not in kinds:
        raise ValueError(f"--pruner must be median, hyperband or none, got {name!r}")
    return kinds[name]()


@dataclass
class TuneResult:
    """A study's outcome: every trial (``number``, ``state``, ``value``, ``params``, ``run_dir``), the best
    completed one, its config file, and the finished trials' runs side by side."""

    study: str
    storage: str
    metric: str
    trials: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, Any] | None = None
    best_config: Path | None = None
    comparison: Comparison | None = None

    def __str__(self) -> str:
        done = [t for t in self.trials if t["state"] in ("COMPLETE", "PRUNED")]
        lines = [str(self.comparison)] if self.comparison is not None else []
        lines.append(f"study {self.study!r} ({self.storage}): {len(done)} trials finished, "
                     f"{sum(t['state'] == 'PRUNED' for t in done)} of them pruned")
        if self.best is not None:
            params = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in self.best["params"].items())
            lines.append(f"best: trial {self.best['number']}, {self.metric} {self.best['value']:.4f} ({params}); "
                         f"config written to {self.best_config}: yolokit train --config {self.best_config}")
        return "\n".join(lines)


def open_study(optuna: Any, handle: Any, name: str, space: Any, config: TrainConfig | dict | None,
               metric: str | None, pruner: str | None) -> Any:
    """The study ``name``: made from ``space`` (and ``config``) when new, else checked against them."""
    names = {s.study_name for s in optuna.get_all_study_summaries(handle, include_best_trial=False)}
    if name not in names:
        if space is None:
            raise ValueError(f"study {name!r} is not in the storage: give a search space to start it")
        source = str(space) if isinstance(space, (str, Path)) else "the search space"
        base = config if isinstance(config, TrainConfig) else TrainConfig.from_dict(config or {})
        space, metric = SearchSpace.load(space), metric or "mAP50-95"
        space.check(base, source)
        made = optuna.create_study(storage=handle, study_name=name, load_if_exists=True,
                                   direction="maximize" if metric in MAXIMIZED else "minimize")
        if "space" not in made.user_attrs:      # another process may have made it a moment before
            for key, value in (("space", space.as_dict()), ("config", base.to_dict()), ("metric", metric),
                               ("pruner", pruner or "median")):
                made.set_user_attr(key, value)
    made = optuna.load_study(study_name=name, storage=handle)
    stored = made.user_attrs
    if space is not None and SearchSpace.load(space).as_dict() != stored["space"]:
        raise ValueError(f"study {name!r} searches another space ({stored['space']}); give the same one, none "
                         "(to join it), or another study name")
    if metric is not None and stored["metric"] != metric:
        raise ValueError(f"study {name!r} optimizes {stored['metric']}, not {metric}")
    return made


def study_config(made: Any, config: TrainConfig | dict | None) -> TrainConfig:
    """The study's base config, with this machine's own ``RUNTIME`` fields from ``config``; other fields that
    ``config`` sets otherwise are an error."""
    theirs = made.user_attrs["config"]
    given = config.to_dict() if isinstance(config, TrainConfig) else dict(config or {})
    mine = TrainConfig.from_dict({**theirs, **given}).to_dict()          # flat augmentation keys win
    differ = sorted(k for k in theirs if k not in RUNTIME and mine[k] != theirs[k])
    if differ:
        raise ValueError(f"study {made.study_name!r} trains with another config: "
                         + "; ".join(f"{k} {theirs[k]!r} there, {mine[k]!r} here" for k in differ))
    return TrainConfig.from_dict({**theirs, **{k: mine[k] for k in RUNTIME}})


def trial_counts(made: Any) -> dict[str, int]:
    states = [t.state.name for t in made.get_trials(deepcopy=False)]
    return {"finished": states.count("COMPLETE") + states.count("PRUNED"), "running": states.count("RUNNING")}


def fail_stale(made: Any) -> None:
    """Trials left RUNNING by a process of this machine that is gone (killed) fail without an error: resumable."""
    state = require_optuna().trial.TrialState
    for t in made.get_trials(deepcopy=False, states=(state.RUNNING,)):
        if t.user_attrs.get("host") == socket.gethostname() and not _alive(int(t.user_attrs.get("pid", 0))):
            made.tell(t.number, state=state.FAIL, skip_if_finished=True)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def enqueue_stopped(made: Any) -> None:
    """Each trial that was stopped (Ctrl-C, SIGTERM, a killed process: failed without an error of its own) and
    not yet taken up again is queued with its params, to continue from its checkpoint."""
    trials = made.get_trials(deepcopy=False)
    taken = {t.user_attrs.get("resumes") for t in trials}
    for t in trials:
        stopped = t.state.name == "FAIL" and "run_dir" in t.user_attrs and "error" not in t.user_attrs
        if stopped and t.number not in taken:
            made.enqueue_trial(t.params, user_attrs={"resumes": t.number})


def trial_of(made: Any, number: int | None) -> Any:
    if number is None:
        return None
    return next(t for t in made.get_trials(deepcopy=False) if t.number == number)


def summarize(made: Any, out: Path, storage: str, metric: str, keep_weights: int | None = None) -> TuneResult:
    """``trials.csv``, ``best.yaml`` and the comparison of the finished trials' runs; with ``keep_weights``
    only the best that many finished trials keep their weights (the others' ``weights/*.pt`` are removed)."""
    result = TuneResult(made.study_name, storage, metric)
    for t in made.get_trials(deepcopy=False):
        result.trials.append({"number": t.number, "state": t.state.name, "value": t.value, "params": dict(t.params),
                              "run_dir": t.user_attrs.get("run_dir"), "threads": t.user_attrs.get("threads")})
    out.mkdir(parents=True, exist_ok=True)
    names = list(dict.fromkeys(k for t in result.trials for k in t["params"]))
    with (out / "trials.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["trial", "state", metric, "run_dir", "threads", *names])
        for t in result.trials:
            writer.writerow([t["number"], t["state"], "" if t["value"] is None else repr(t["value"]), t["run_dir"],
                             t["threads"], *(t["params"].get(k, "") for k in names)])
    done = [t for t in result.trials if t["state"] in ("COMPLETE", "PRUNED") and t["run_dir"]
            and (Path(t["run_dir"]) / "results.csv").is_file()]
    sign = -1.0 if made.direction.name == "MAXIMIZE" else 1.0    # best first, then the pruned ones
    done.sort(key=lambda t: (t["state"] != "COMPLETE", sign * t["value"] if t["value"] is not None else math.inf))
    if done:
        result.comparison = compare_runs([t["run_dir"] for t in done])
    if keep_weights is not None:            # a sweep that keeps only its best trials' weights
        for t in done[keep_weights:]:
            for file in (Path(t["run_dir"]) / "weights").glob("*.pt"):
                file.unlink(missing_ok=True)
    complete = [t for t in done if t["state"] == "COMPLETE"]
    if complete:
        result.best = complete[0]
        result.best_config = write_best(result.best, made.study_name, storage, metric, out / "best.yaml")
    return result


def write_best(best: dict[str, Any], study: str, storage: str, metric: str, path: Path) -> Path:
    """The best trial's config (as its run saved it) as a TrainConfig YAML, for ``yolokit train --config``."""
    run = Path(best["run_dir"])
    config = TrainConfig.from_yaml(run / "config.yaml").replace(out=TrainConfig.out, resume=None)
    path.write_text(f"# the best trial of study {study!r} ({storage}): trial {best['number']}, {metric} "
                    f"{best['value']!r} at its best epoch ({run})\n# it trained with {best['threads']} CPU threads "
                    "per process: on the CPU the same count (OMP_NUM_THREADS) retrains it bit for bit\n"
                    + yaml.safe_dump(config.to_dict(), sort_keys=False))
    return path
