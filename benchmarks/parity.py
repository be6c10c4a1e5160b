"""Both trainers on one preset, several seeds each: yolokit and the reference (Ultralytics), every final weight
scored by one evaluator (yolokit's validation), a table per seed and its mean, min and max.

    /tmp/benchenv/bin/python benchmarks/parity.py --model yolov8n-seg --data shapes-seg --seeds 0 1 2 \
        --out runs/parity/seg [--epochs 25 --imgsz 256 ...] [--sides yolokit reference]

Run with an interpreter where both yolokit and ultralytics import (the bench environment). Each run is a
process of its own (``--one SIDE SEED``), one after the other, so that neither trainer's settings (threads,
OpenCV, seeds) reach the other. Both sides get the set's preset of `yolokit train` (``cli.PRESETS``: epochs,
image size, batch, nominal batch, warmup epochs, close_mosaic) where flags give none; the rest is each side's
default. Every run's ``results.csv`` is kept (its curves); the final weights (``last.pt``) of both sides are
scored with ``yolokit.val.validate`` (box and, for a -seg model, mask mAP; the reference's checkpoints load
weights-only). ``table.md`` and ``runs.json`` are written to ``--out``; a run whose ``last.pt`` is there
already is scored, not trained again.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

KEYS = ("mAP50", "mAP50-95", "mask_mAP50", "mask_mAP50-95")


def data_yaml(data: str) -> Path:
    """A data.yaml for ``data`` ("shapes", "shapes-seg", or a path)."""
    from yolokit.data import make_shapes

    if data in ("shapes", "shapes-seg"):
        return Path(make_shapes(segments=data == "shapes-seg"))
    return Path(data)


def train_one(side: str, seed: int, args: argparse.Namespace) -> None:
    """One run of ``side`` with ``seed`` into ``--out/<side>-<seed>``."""
    out = Path(args.out) / f"{side}-{seed}"
    preset = dict(epochs=args.epochs, imgsz=args.imgsz, batch=args.batch, nbs=args.nbs,
                  warmup_epochs=args.warmup_epochs, close_mosaic=args.close_mosaic)
    if side == "yolokit":
        from yolokit.train import TrainConfig, train

        train(TrainConfig(model=args.model, data=str(data_yaml(args.data)), seed=seed, out=str(out),
                          workers=args.workers, plots=False, **preset))
        return
    from ultralytics import YOLO

    YOLO(f"{args.model}.yaml").train(data=str(data_yaml(args.data)), seed=seed, deterministic=True, device="cpu",
                                     workers=args.workers, project=str(out.parent), name=out.name, exist_ok=True,
                                     plots=False, verbose=False, **preset)


def score(weights: Path, args: argparse.Namespace) -> dict:
    """yolokit's validation of ``weights`` on the set's val split at the preset's size."""
    import yolokit
    from yolokit.data import DetectionDataset, build_dataloader
    from yolokit.val import validate

    model = yolokit.load(str(weights)).eval()
    loader = build_dataloader(DetectionDataset(data_yaml(args.data), "val", imgsz=args.imgsz, rect=True,
                                               stride=max(model.strides)), 16, workers=0, shuffle=False)
    result, _ = validate(model, loader, num_classes=model.num_classes)
    return {"mAP50": result.map50, "mAP50-95": result.map50_95, "mask_mAP50": result.mask_map50,
            "mask_mAP50-95": result.mask_map50_95}


def curve(side: str, run: Path) -> dict:
    """Per epoch mAP50-95 (and mask mAP50-95) as the run's own validation wrote it."""
    rows = list(csv.DictReader((run / "results.csv").open()))
    rows = [{k.strip(): v for k, v in r.items()} for r in rows]
    box = "mAP50-95" if side == "yolokit" else "metrics/mAP50-95(B)"
    mask = "mask_mAP50-95" if side == "yolokit" else "metrics/mAP50-95(M)"
    return {"box": [float(r[box]) for r in rows], "mask": [float(r[mask]) for r in rows if mask in r]}


def summary(runs: list[dict], side: str, key: str) -> str:
    values = np.array([r["scores"][key] for r in runs if r["side"] == side and r["scores"].get(key) is not None])
    return f"{values.mean():.3f} ({values.min():.3f}-{values.max():.3f})" if len(values) else "-"


def main() -> int:
    from yolokit.cli import PRESETS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="yolov8n")
    parser.add_argument("--data", default="shapes")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--sides", nargs="+", default=["yolokit", "reference"], choices=["yolokit", "reference"])
    parser.add_argument("--out", default="runs/parity")
    parser.add_argument("--workers", type=int, default=2)
    for k, v in PRESETS["shapes"].items():                   # the set's preset where a flag gives none
        parser.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=None)
    parser.add_argument("--one", nargs=2, metavar=("SIDE", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    for k, v in PRESETS.get(args.data, PRESETS["shapes"]).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.one:
        train_one(args.one[0], int(args.one[1]), args)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for seed in args.seeds:
        for side in args.sides:
            run = out / f"{side}-{seed}"
            start = time.perf_counter()
            if not (run / "weights" / "last.pt").is_file():
                subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", side, str(seed)], check=True)
            seconds = time.perf_counter() - start
            runs.append({"side": side, "seed": seed, "seconds": round(seconds, 1), "curve": curve(side, run),
                         "scores": score(run / "weights" / "last.pt", args)})
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "curve"}), flush=True)
    (out / "runs.json").write_text(json.dumps(runs, indent=1))
    keys = [k for k in KEYS if any(r["scores"].get(k) is not None for r in runs)]
    lines = [f"| side | seed | {' | '.join(keys)} |", "|---|---|" + "---|" * len(keys)]
    for r in runs:
        lines.append(f"| {r['side']} | {r['seed']} | " + " | ".join(f"{r['scores'][k]:.3f}" for k in keys) + " |")
    for side in args.sides:
        lines.append(f"| {side} | mean (min-max) | " + " | ".join(summary(runs, side, k) for k in keys) + " |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
