"""Speed and memory of yolokit measured side by side with a reference implementation.

Each case times yolokit and the reference (Ultralytics, when it can be imported) in
turns, A B A B ..., and reports medians and the ratio yolokit / reference of the time
per call (per image for throughput), so below 1.0 means yolokit is faster.

    >>> from harness.runner import run  # doctest: +SKIP
    >>> results = run(["nms", "loss"], quick=True)  # doctest: +SKIP
    >>> results[0].ratio  # doctest: +SKIP

From the command line: ``python benchmarks/run.py --cases nms loss``. The reference side
needs the ``bench`` extra (``ultralytics``), best installed in its own virtual
environment; without it only yolokit's numbers are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from harness import reference as _reference
from harness.cases import CASES, Row, Settings
from harness.timing import alternate, command, machine, median, peak_memory, versions

__all__ = ["CASES", "Result", "Settings", "main", "run"]


@dataclass
class Result:
    """Timings of one row.

    Attributes:
        case: the case name (``train``, ``inference``, ``nms``, ``loss``, ``data``, ``eval``).
        label: the row.
        unit: "ms" (per call) or "img/s".
        ours: yolokit's counted runs, seconds per unit.
        theirs: the reference's counted runs (empty without a reference).
        ours_peak_mb, theirs_peak_mb: extra memory of one call at its peak, MiB (None: not measured).
        notes: what was run.
    """

    case: str
    label: str
    unit: str
    ours: list[float]
    theirs: list[float] = field(default_factory=list)
    ours_peak_mb: float | None = None
    theirs_peak_mb: float | None = None
    notes: list[str] = field(default_factory=list)

    def value(self, runs: list[float]) -> float:
        """The median in the row's unit (ms per call, or images per second)."""
        m = median(runs)
        return 1.0 / m if self.unit == "img/s" else m * 1e3

    @property
    def ratio(self) -> float | None:
        """Median time per unit of yolokit over the reference's (None without a reference)."""
        return median(self.ours) / median(self.theirs) if self.theirs else None


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_row(r: Result) -> str:
    ours, theirs = r.value(r.ours), (r.value(r.theirs) if r.theirs else None)
    return (f"  {r.label:<44}{_fmt(ours):>10} {r.unit:<5}{_fmt(theirs):>10} {r.unit:<5}"
            f"{_fmt(r.ratio, 2):>7}")


def _header(reference: str | None) -> list[str]:
    return [
        f"command: {command()}",
        f"machine: {machine()}",
        f"versions: {versions({'ultralytics': reference} if reference else None)}",
        "reference: " + (f"Ultralytics {reference}" if reference else "none (ultralytics not importable): "
                         "yolokit numbers only"),
        "ratio = yolokit / reference time per call (per image for img/s): below 1.0 yolokit is faster; "
        "runs alternate A B A B, values are medians",
    ] + _busy_warning()


def _busy_warning() -> list[str]:
    """A warning when other processes already keep the CPUs busy (load average above a quarter of them)."""
    if not hasattr(os, "getloadavg"):
        return []
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if load <= 0.25 * cpus:
        return []
    return [f"warning: load average {load:.2f} on {cpus} CPUs before starting: other processes compete for the "
            "CPUs, so timings are slower and noisier (both sides alike, as runs alternate)"]


def _peaks(row: Row) -> tuple[float | None, float | None]:
    """Peak extra MiB of one call of each side (run after all timings: it changes malloc settings)."""
    peaks = [None if (b := peak_memory(fn)) is None else b / 2**20 for fn in (row.ours, row.theirs) if fn]
    return peaks[0], (peaks[1] if len(peaks) > 1 else None)


def run(cases: Sequence[str] | None = None, *, quick: bool = False, reference: bool | None = None,
        repeats: int | None = None, warmup: int | None = None,
        echo: Callable[[str], None] | None = print) -> list[Result]:
    """Runs benchmark cases and returns their results (printing as it goes).

    Args:
        cases: names from ``CASES`` (default all), in the order given.
        quick: smaller inputs and fewer runs, for a smoke test.
        reference: time Ultralytics too; ``None`` when it can be imported.
        repeats: counted runs per side (default 7, quick 3).
        warmup: uncounted rounds (default 2, quick 1).
        echo: where lines go (``None``: silent).

    Returns:
        One ``Result`` per row.
    """
    say = echo or (lambda _line: None)
    names = list(cases or CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise ValueError(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    version = _reference.version() if reference is not False else None
    if reference and version is None:
        raise ValueError("reference=True but ultralytics cannot be imported (pip install 'yolokit[bench]')")
    s = Settings(quick=quick, warmup=warmup if warmup is not None else (1 if quick else 2),
                 repeats=repeats if repeats is not None else (3 if quick else 7), reference=version)
    if s.repeats < 1:
        raise ValueError("repeats must be >= 1")
    for line in _header(version):
        say(line)
    results, pending = [], []
    for name in names:
        case = CASES[name]
        load = f" (load average {os.getloadavg()[0]:.2f})" if hasattr(os, "getloadavg") else ""
        say(f"\n== {name}: {case.title} =={load}")
        say(f"  {'':<44}{'yolokit':>16}{'reference':>16}{'ratio':>7}")
        torch.manual_seed(0)
        for row in case.build(s):
            fns = [row.ours] + ([row.theirs] if row.theirs else [])
            runs = alternate(fns, warmup=s.warmup, repeats=s.repeats, inner=row.inner)
            result = Result(name, row.label, row.unit, runs[0], runs[1] if len(runs) > 1 else [], notes=row.notes)
            results.append(result)
            if row.memory:
                pending.append((result, row))
            say(format_row(result))
            for note in row.notes:
                say(f"      {note}")
            say("      runs: yolokit " + " ".join(_fmt(result.value([v]), 1) for v in result.ours)
                + ("; reference " + " ".join(_fmt(result.value([v]), 1) for v in result.theirs)
                   if result.theirs else ""))
    if pending:
        say("\n== peak memory: extra resident memory of one call at its peak, MiB (measured after all timings) ==")
        say(f"  {'':<44}{'yolokit':>10}{'reference':>11}")
        for result, row in pending:
            result.ours_peak_mb, result.theirs_peak_mb = _peaks(row)
            say(f"  {result.case + ': ' + result.label:<44}{_fmt(result.ours_peak_mb, 0):>10}"
                f"{_fmt(result.theirs_peak_mb, 0):>11}")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """Command line of ``benchmarks/run.py``: runs the cases, optionally writes JSON; the exit status."""
    parser = argparse.ArgumentParser(prog="benchmarks/run.py", description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=None, metavar="CASE",
                        help=f"cases to run, in order (default all: {' '.join(CASES)})")
    parser.add_argument("--quick", action="store_true", help="small inputs, few runs: a smoke test, not for reporting")
    parser.add_argument("--no-reference", action="store_true", help="time yolokit only, even if ultralytics imports")
    parser.add_argument("--repeats", type=int, default=None, help="counted runs per side (default 7; quick 3)")
    parser.add_argument("--warmup", type=int, default=None, help="uncounted rounds first (default 2; quick 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        results = run(args.cases, quick=args.quick, reference=False if args.no_reference else None,
                      repeats=args.repeats, warmup=args.warmup)
    except ValueError as exc:
        print(f"benchmarks/run.py: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command(), "machine": machine(),
                       "versions": versions({"ultralytics": _reference.version() or "-"}),
                       "results": [{**asdict(r), "ratio": r.ratio} for r in results]}, f, indent=1)
    return 0
