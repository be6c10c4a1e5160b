"""The ablation table of several ``benchmarks/parity.py`` runs: one row per setting and side, mAP50-95 and mAP50
as mean (min-max) over its seeds, the first epoch at mAP50 0.5, and the change of the mean against the first
row of the same side (the baseline) over the seeds both have.

    python benchmarks/parity_table.py --row "both recipes as they are" benchmarks/parity-runs/shapes-yolov8n.json \
        --row "yolokit: warmup_min_steps=0" benchmarks/parity-runs/shapes-yolov8n-yk-warmup-min0.json ...

Each ``--row LABEL PATH`` is a parity run's ``runs.json`` (every side in it gets a row); the seeds of each row
are listed, so rows over different seeds are never read as one comparison. ``--base-row LABEL PATH`` is a row
that the rows after it compare with instead (another baseline: runs of the same seeds in other conditions).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.timing import header  # noqa: E402


def rows(label: str, runs: list[dict], *, base: bool = False) -> list[dict]:
    """One row per side of ``runs``: its seeds and the numbers of each; ``base``: a baseline for the rows after."""
    out = []
    for side in dict.fromkeys(r["side"] for r in runs):
        mine = sorted((r for r in runs if r["side"] == side), key=lambda r: r["seed"])
        out.append({"label": label, "side": side, "seeds": [r["seed"] for r in mine],
                    "box": [r["scores"]["mAP50-95"] for r in mine], "box50": [r["scores"]["mAP50"] for r in mine],
                    "first": [r["curve"]["first_50"] for r in mine], "base": base})
    return out


def spread(values: list, digits: int = 3) -> str:
    """Mean (min-max) of the numbers in ``values`` (None: never reached, left out and counted)."""
    known = np.array([v for v in values if v is not None], float)
    if not len(known):
        return "-"
    text = f"{known.mean():.{digits}f} ({known.min():.{digits}f}-{known.max():.{digits}f})"
    return text + (f", {len(values) - len(known)} never" if len(known) < len(values) else "")


def table(all_rows: list[dict]) -> list[str]:
    """The markdown table: the change of the mean against the side's first row."""
    base: dict[str, dict] = {}
    lines = ["| setting | side | seeds | mAP50-95 | change of the mean (same seeds) | mAP50 | epoch at mAP50 0.5 |",
             "|---|---|---|---|---:|---|---|"]
    for row in all_rows:
        first = base[row["side"]] = row if row["base"] else base.get(row["side"], row)   # --base-row: anew
        change = "baseline" if first is row else _change(first, row)
        lines.append(f"| {row['label']} | {row['side']} | {', '.join(map(str, row['seeds']))} | {spread(row['box'])} | "
                     f"{change} | {spread(row['box50'])} | {spread(row['first'], 1)} |")
    return lines


def _change(base: dict, row: dict) -> str:
    """The change of ``row``'s mean mAP50-95 against ``base``'s over the seeds both have (named when not all)."""
    theirs = dict(zip(base["seeds"], base["box"], strict=True))
    common = [(v, theirs[s]) for s, v in zip(row["seeds"], row["box"], strict=True) if s in theirs]
    if not common:
        return "no seed in common"
    mine, before = np.array(common).T
    note = "" if len(common) == len(base["seeds"]) == len(row["seeds"]) else \
        f" (seeds {', '.join(str(s) for s in row['seeds'] if s in theirs)}: {before.mean():.3f} before)"
    return f"{mine.mean() - before.mean():+.3f}{note}"


class _Rows(argparse.Action):
    """``--row`` and ``--base-row`` into one list, in order: (label, path, is a baseline)."""

    def __call__(self, parser, namespace, values, option_string=None):
        getattr(namespace, self.dest).append((*values, option_string == "--base-row"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.set_defaults(rows=[])
    parser.add_argument("--row", nargs=2, action=_Rows, dest="rows", required=True, metavar=("LABEL", "RUNS_JSON"))
    parser.add_argument("--base-row", nargs=2, action=_Rows, dest="rows", metavar=("LABEL", "RUNS_JSON"),
                        help="a row that the rows after it compare with")
    args = parser.parse_args()
    all_rows = [r for label, path, base in args.rows
                for r in rows(label, json.loads(Path(path).read_text()), base=base)]
    print(header())
    print("\n".join(table(all_rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
