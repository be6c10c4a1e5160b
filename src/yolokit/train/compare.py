"""Two or more training runs side by side, from their folders: what each reached and what differs.

``compare_runs(["runs/train", "runs/train2"])`` reads each run's ``results.csv`` and
``config.yaml`` (nothing else: runs on other machines compare once their folders are copied)
and returns a :class:`Comparison`; printed, it is a table and the config fields that differ.
``yolokit compare runs/train runs/train2`` prints the same.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from yolokit.train.config import TrainConfig

IGNORED = {"out", "resume"}        # where a run was written says nothing about how it trained


@dataclass
class Comparison:
    """Per run: ``rows`` (run, model, epochs, best epoch and its mAP50-95 / mAP50, the last epoch's,
    hours of training and validation); ``differences``: each config field whose values differ, with
    the value of each run in order."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    differences: dict[str, list[Any]] = field(default_factory=dict)

    def __str__(self) -> str:
        head = ["run", "model", "epochs", "best", "mAP50-95", "mAP50", "last mAP50-95", "time"]
        cells = [[str(r["run"]), str(r["model"]), f"{r['epochs']}/{r['epochs_asked']}", str(r["best_epoch"]),
                  f"{r['mAP50-95']:.4f}", f"{r['mAP50']:.4f}", f"{r['last_mAP50-95']:.4f}", _duration(r["hours"])]
                 for r in self.rows]
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
        lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
        if self.differences:
            lines.append("differs: " + "; ".join(f"{k} " + " vs ".join(map(str, v))
                                                 for k, v in self.differences.items()))
        else:
            lines.append("the configs are the same")
        return "\n".join(lines)


def read_run(run: str | Path) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """A run folder's config (a dict of TrainConfig fields) and results rows (numbers)."""
    run = Path(run)
    config_path, results_path = run / "config.yaml", run / "results.csv"
    for path in (config_path, results_path):
        if not path.is_file():
            raise FileNotFoundError(f"{run} is not a training run folder with an epoch done: {path.name} is missing")
    config = TrainConfig.from_dict(yaml.safe_load(config_path.read_text()) or {}).to_dict()
    rows = [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(results_path.open())]
    if not rows:
        raise ValueError(f"{results_path} has no epoch row")
    return config, rows


def compare_runs(runs: Sequence[str | Path]) -> Comparison:
    """Reads each run folder and compares them; the best epoch is the one of highest ``fitness``
    (0.1 mAP50 + 0.9 mAP50-95, the one ``best.pt`` keeps)."""
    if len(runs) < 1:
        raise ValueError("compare_runs needs at least one run folder")
    read = [read_run(r) for r in runs]
    comparison = Comparison()
    for run, (config, rows) in zip(runs, read, strict=True):
        best = max(rows, key=lambda r: r.get("fitness", -math.inf))
        comparison.rows.append({
            "run": str(run), "model": config["model"], "epochs": int(rows[-1]["epoch"]),
            "epochs_asked": config["epochs"], "best_epoch": int(best["epoch"]), "mAP50-95": best.get("mAP50-95", 0.0),
            "mAP50": best.get("mAP50", 0.0), "last_mAP50-95": rows[-1].get("mAP50-95", 0.0),
            "hours": sum(r.get("seconds", 0.0) for r in rows) / 3600})
    flat = [_flat(config) for config, _ in read]
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


def _duration(hours: float) -> str:
    seconds = hours * 3600
    return f"{seconds:.0f}s" if seconds < 60 else f"{seconds / 60:.1f}min" if seconds < 3600 else f"{hours:.2f}h"
