"""What every experiment tracker shares: the :class:`Tracker` base, its error, and the helpers that
flatten a config and name metrics (:mod:`yolokit.train.trackers.catalog` builds the trackers;
:mod:`yolokit.train.trackers.mlflow_tracker` and the others in ``catalog`` derive from the base here, so
that neither tracker module imports the other's)."""

from __future__ import annotations

import importlib
import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

from yolokit.train.callbacks import Callback


class TrackerError(RuntimeError):
    """A tracker could not start its run (no login, an unreachable server, ...): one line that says
    where it tried to write and what to install or set."""


def one_line(exc: BaseException, limit: int = 240) -> str:
    """``"Type: message"`` on one line, cut at ``limit`` characters."""
    text = " ".join(str(exc).split())
    text = text if len(text) <= limit else text[:limit] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _require(name: str) -> Any:
    """The tracker library ``name``, imported now; missing, an error naming its extra."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(f"--tracker {name} needs the {name} package: pip install 'yolokit[{name}]' "
                          f"(or pip install {name}); {one_line(exc)}") from None
    except Exception as exc:                          # installed but broken
        raise TrackerError(f"--tracker {name} could not import {name} ({one_line(exc)}); reinstall it: "
                           f"pip install --force-reinstall 'yolokit[{name}]'") from None


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
    ``close(status)`` (status: "finished", "interrupted" or "failed"), and may implement ``open()`` (reach
    the store, no run yet), ``where()`` (the URI or folder it writes to) and ``advice(exc)`` (what to
    install or set when starting failed). An exception that ends a run on purpose (a sweep's pruned
    trial) may carry ``run_status = "interrupted"``: the run is then closed as interrupted, not failed.
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
        self.guarded(self.start, config)

    def guarded(self, action: Any, *args: Any) -> None:
        """``action(*args)``; any failure as one :class:`TrackerError` line naming ``where()`` and ``advice()``."""
        try:
            action(*args)
        except TrackerError:
            raise
        except Exception as exc:                   # an ImportError here is a part the store needs (SQLAlchemy, ...)
            raise TrackerError(f"--tracker {self.name} could not start a run at {self.where()} ({one_line(exc)}); "
                               f"{self.advice(exc)}") from exc

    def open(self) -> None:
        """Reaches the store (no run yet); errors as :meth:`start`'s."""

    def where(self) -> str:
        return str(self.run_dir)

    def advice(self, exc: Exception) -> str:
        return "check that this folder can be written"

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
        if self.exported is None and self.status == "failed":   # called while the exception that ended the run
            self.status = getattr(sys.exc_info()[1], "run_status", "failed")   # propagates
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
