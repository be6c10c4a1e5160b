"""Two or more training runs side by side, from their folders: what each reached and what differs.

``compare_runs(["runs/train", "runs/train2"])`` reads each run's ``results.csv`` and
``config.yaml`` (nothing else: runs on other machines compare once their folders are copied)
and returns a :class:`Comparison`; printed, it is a table and the config fields that differ.
``yolokit compare runs/train runs/train2`` prints the same. ``read_results("runs/train")`` is one
run's :class:`RunResults`: its rows, a one-line summary, and its curves (``plot()``).

In a notebook each shows itself as HTML tables (``_repr_html_``), and the figure of ``plot()`` inline.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from yolokit.train.config import TrainConfig
from yolokit.val.metrics import html_table
from yolokit.viz import curve_keys, epoch_rows, run_curves

if TYPE_CHECKING:
    from matplotlib.figure import Figure

IGNORED = {"out", "resume", "verbose"}   # where a run was written and what it printed say nothing of how it trained
DECIMALS = {"epoch": 0, "seconds": 1}  # of a run's table; other numbers to 4


@dataclass
class Comparison:
    """Per run: ``rows`` (run, model, epochs, best epoch and its mAP50-95 / mAP50, the last epoch's,
    hours of training and validation); ``differences``: each config field whose values differ, with
    the value of each run in order."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    differences: dict[str, list[Any]] = field(default_factory=dict)

    HEAD = ("run", "model", "epochs", "best", "mAP50-95", "mAP50", "last mAP50-95", "time")

    def _cells(self) -> list[list[str]]:
        """The table's text cells, a row per run, in the order of ``HEAD``."""
        return [[str(r["run"]), str(r["model"]), f"{r['epochs']}/{r['epochs_asked']}", str(r["best_epoch"]),
                 f"{r['mAP50-95']:.4f}", f"{r['mAP50']:.4f}", f"{r['last_mAP50-95']:.4f}", _duration(r["hours"])]
                for r in self.rows]

    def __str__(self) -> str:
        cells = self._cells()
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(self.HEAD)]
        lines = ["  ".join(h.ljust(w) for h, w in zip(self.HEAD, widths, strict=True))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
        if self.differences:
            lines.append("differs: " + "; ".join(f"{k} " + " vs ".join(map(str, v))
                                                 for k, v in self.differences.items()))
        else:
            lines.append("the configs are the same")
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        """The table of ``str()``, then the differing config fields, a column per run (a notebook shows it)."""
        html = html_table(self.HEAD, self._cells())
        if not self.differences:
            return html + "<p>the configs are the same</p>"
        runs = [str(r["run"]) for r in self.rows]
        return html + html_table(["differs", *runs], [[k, *v] for k, v in self.differences.items()])


@dataclass
class RunResults:
    """A training run as its folder holds it (``read_results``): config and epoch rows.

    Printed, one line (folder, epochs done, the best epoch and its mAP50-95); in a notebook, its rows as a
    table (``_repr_html_``); ``plot()`` draws its curves.

    Attributes:
        run_dir: the run folder.
        config: its ``config.yaml``, a dict of TrainConfig fields.
        rows: its ``results.csv``, a dict of numbers per epoch done (at least one).
    """

    run_dir: Path
    config: dict[str, Any]
    rows: list[dict[str, float]]

    @property
    def best(self) -> dict[str, float]:
        """The row of the best epoch: highest ``fitness`` (0.1 mAP50 + 0.9 mAP50-95, the one ``best.pt`` keeps)."""
        return max(self.rows, key=lambda r: r.get("fitness", -math.inf))

    def plot(self) -> Figure:
        """The losses and metrics per epoch, ``yolokit.viz.run_curves``' figure (``results.png``'s)."""
        return run_curves(self.rows)

    def __repr__(self) -> str:
        best = self.best
        return (f"RunResults({str(self.run_dir)!r}, {int(self.rows[-1]['epoch'])}/{self.config['epochs']} epochs, "
                f"best epoch {int(best['epoch'])} mAP50-95 {best.get('mAP50-95', 0.0):.4f})")

    def _repr_html_(self) -> str:
        """``repr()``, then a row per epoch: epoch, the losses, P, R, mAP50, mAP50-95 and seconds."""
        columns = ["epoch", *curve_keys(self.rows), *(["seconds"] if any("seconds" in r for r in self.rows) else [])]
        rows = [[_cell(r, c) for c in columns] for r in self.rows]
        return f"<p>{escape(repr(self))}</p>" + html_table(columns, rows)


def read_results(run: str | Path) -> RunResults:
    """A run folder's :class:`RunResults` (see ``read_run`` for what it must hold)."""
    return RunResults(Path(run), *read_run(run))


def read_run(run: str | Path) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """A run folder's config (a dict of TrainConfig fields) and results rows (numbers)."""
    run = Path(run)
    config_path, results_path = run / "config.yaml", run / "results.csv"
    for path in (config_path, results_path):
        if not path.is_file():
            raise FileNotFoundError(f"{run} is not a training run folder with an epoch done: {path.name} is missing")
    config = TrainConfig.from_dict(yaml.safe_load(config_path.read_text()) or {}).to_dict()
    rows = epoch_rows(results_path)
    if not rows:
        raise ValueError(f"{results_path} has no epoch row")
    return config, rows


def compare_runs(runs: Sequence[str | Path]) -> Comparison:
    """Reads each run folder and compares them; the best epoch is the one of highest ``fitness``
    (0.1 mAP50 + 0.9 mAP50-95, the one ``best.pt`` keeps)."""
    if len(runs) < 1:
        raise ValueError("compare_runs needs at least one run folder")
    read = [read_results(r) for r in runs]
    comparison = Comparison()
    for run, result in zip(runs, read, strict=True):
        config, rows, best = result.config, result.rows, result.best
        comparison.rows.append({
            "run": str(run), "model": config["model"], "epochs": int(rows[-1]["epoch"]),
            "epochs_asked": config["epochs"], "best_epoch": int(best["epoch"]), "mAP50-95": best.get("mAP50-95", 0.0),
            "mAP50": best.get("mAP50", 0.0), "last_mAP50-95": rows[-1].get("mAP50-95", 0.0),
            "hours": sum(r.get("seconds", 0.0) for r in rows) / 3600})
    flat = [_flat(r.config) for r in read]
    for key in flat[0]:
        values = [f.get(key) for f in flat]
        if key not in IGNORED and any(v != values[0] for v in values):
            comparison.differences[key] = values
    return comparison


def _flat(config: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in config.items() if not isinstance(v, dict)}
    for v in config.values():
        if isinstance(v, dict):
            out.update(v)                      # augmentation fields, named as the flags name them
    return out


def _cell(row: dict[str, float], column: str) -> str:
    """A results.csv number as the run's table shows it: epoch whole, seconds to 0.1, others to 4 decimals."""
    value = row.get(column)
    return "" if value is None else f"{value:.{DECIMALS.get(column, 4)}f}"


def _duration(hours: float) -> str:
    seconds = hours * 3600
    return f"{seconds:.0f}s" if seconds < 60 else f"{seconds / 60:.1f}min" if seconds < 3600 else f"{hours:.2f}h"
