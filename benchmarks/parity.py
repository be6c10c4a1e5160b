"""Both trainers on one preset, several seeds each: yolokit and the reference (Ultralytics), every final weight
scored by one evaluator (yolokit's validation; an end-to-end model's one-to-one branch too, without NMS), a table
per seed and its mean, min and max.

    /tmp/benchenv/bin/python benchmarks/parity.py --model yolov8n-seg --data shapes-seg --seeds 0 1 2 \
        --out runs/parity/seg [--epochs 25 --imgsz 256 ...] [--sides yolokit reference] \
        [--set yolokit.warmup_min_steps=0 --set reference.warmup_bias_lr=0.1 ...] \
        [--set yolokit.assigner.contested=any]

Run with an interpreter where both yolokit and ultralytics import (the bench environment). Each run is a process of
its own (``--one SIDE SEED``), one after the other, so that neither trainer's settings (threads, OpenCV, seeds) reach
the other; each starts with this command's environment as it was at its start (importing ultralytics, as the
reference validator does, sets ``OMP_NUM_THREADS=1``, which a later yolokit run would otherwise inherit: one thread
instead of the machine's). Both sides get the set's preset of `yolokit train` (``cli.PRESETS``: epochs, image size,
batch, nominal batch, warmup epochs, close_mosaic) where flags give none; the rest is each side's default. Every
run's ``results.csv`` is kept (its curves); the final weights (``last.pt``) of both sides are scored with
``yolokit.val.validate`` (box and, for a -seg model, mask mAP; the reference's checkpoints load weights-only) and,
where ultralytics imports, with the reference validator too (its defaults: rect batches padded by half a stride;
yolokit's weights copied into an Ultralytics model by ``val_parity.ultralytics_checkpoint``). Each run's curve is
read from its own ``results.csv``: mAP50 and mAP50-95 per epoch, and the first epoch whose mAP50 reaches 0.5.
``table.md``, ``runs.json`` and ``curves.png`` (every run's curves, each side's mean bold) are written to ``--out``;
a run that finished already (``last.pt`` and a row per epoch) is scored, not trained again; after a Ctrl-C (exit
130, one line) the same command goes on: a yolokit run cut short resumes from its checkpoint, a reference run
starts again. ``--set
yolokit.assigner.KEY=VALUE``: an option of yolokit's ``TaskAlignedAssigner`` that the trainer has no setting for
(``contested``: the reference's handling of a point several GTs kept), given to every loss's assigner of the run and
written to its folder (``assigner.yaml``): an ablation's switch. ``--set reference.albumentations=false``: the
reference's run without its albumentations step (blur, median blur, gray, CLAHE at p 0.01), as where the package is
not installed. A command with the reference's side stops before its first run where ultralytics or polars (which
the reference imports at its first checkpoint save) does not import.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

START_ENV = dict(os.environ)   # each run's environment: this command's, before any import changes it
KEYS = ("mAP50", "mAP50-95", "mask_mAP50", "mask_mAP50-95", "one-to-one mAP50-95")


# what the reference imports only once it trains: 8.4 reads its results.csv with polars at every checkpoint save,
# so a run without it fails an epoch in (and a command of several runs an hour in); a command checks first
REFERENCE_IMPORTS = ("ultralytics", "polars")


def reference_unready() -> list[str]:
    """The modules of ``REFERENCE_IMPORTS`` this interpreter cannot import."""
    import importlib.util

    return [name for name in REFERENCE_IMPORTS if importlib.util.find_spec(name) is None]


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
    preset.update(overrides(args.set, side))
    if side == "yolokit":
        from yolokit.train import TrainConfig, train

        assigner = {k.partition(".")[2]: preset.pop(k) for k in [k for k in preset if k.startswith("assigner.")]}
        if assigner:
            patch_assigner(assigner, out)
        if (out / "weights" / "last.pt").is_file():      # a run a stop cut short: on from its step (exact)
            train(TrainConfig(resume=str(out)))
        else:
            train(TrainConfig.from_dict({**dict(model=args.model, data=str(data_yaml(args.data)), seed=seed,
                                                 out=str(out), workers=args.workers, plots=False,
                                                 device=args.device),
                                         **preset}))   # from_dict: flat augmentation keys too (--set yolokit.hsv_h=0)
        record_threads(out)
        return
    if preset.pop("albumentations", True) is False:   # its Albumentations step skips itself when the import fails
        sys.modules["albumentations"] = None
        out.mkdir(parents=True, exist_ok=True)
        (out / "ablation.yaml").write_text("albumentations: false\n")
    # its MLflow logger (on where mlflow imports) writes into the run's folder, not the working folder
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{out.resolve()}/mlflow.db")
    from ultralytics import YOLO

    device = "cpu" if args.device == "cpu" else args.device.replace("cuda:", "").replace("cuda", "0")   # theirs: "0"
    model = args.model if args.model.endswith(".yaml") else f"{args.model}.yaml"    # yolo26n.yaml: a packaged YAML
    YOLO(model).train(**{**dict(data=str(data_yaml(args.data)), seed=seed, deterministic=True,
                                               device=device, workers=args.workers, project=str(out.parent),
                                               name=out.name, exist_ok=True, plots=False, verbose=False), **preset})
    record_threads(out)


def train_process(cmd: list[str]) -> int:
    """Run ``cmd`` (one run) and return its exit code. A Ctrl-C reaches the run too (one process group): this one
    waits while the run stops at its own pace (yolokit's saves its checkpoint whole), and passes the signal on
    only where the run did not get it (a ``kill -INT`` of this process alone)."""
    import signal

    with subprocess.Popen(cmd, env=START_ENV) as child:
        try:
            return child.wait()
        except KeyboardInterrupt:
            try:
                return child.wait(timeout=2)
            except subprocess.TimeoutExpired:
                child.send_signal(signal.SIGINT)
                return child.wait()


def record_threads(out: Path) -> None:
    """The torch threads the run trained on, into ``out/threads.txt`` (``runs.json``'s ``threads``): the same seed
    on another number of threads is another run (another order of the same sums)."""
    import torch

    (out / "threads.txt").write_text(f"{torch.get_num_threads()}\n")


def patch_assigner(options: dict, out: Path) -> None:
    """Every loss of this process builds its ``TaskAlignedAssigner`` with ``options`` (a loss's own arguments
    still win); they are written to ``out/assigner.yaml``."""
    import functools

    import yaml

    import yolokit.losses.yolo26 as yolo26
    import yolokit.losses.yolov8 as yolov8
    from yolokit.losses.assigners import TaskAlignedAssigner

    TaskAlignedAssigner(**options)                                       # a bad option fails here, in one line
    yolov8.TaskAlignedAssigner = yolo26.TaskAlignedAssigner = functools.partial(TaskAlignedAssigner, **options)
    out.mkdir(parents=True, exist_ok=True)
    (out / "assigner.yaml").write_text(yaml.safe_dump(options))


def overrides(pairs: list[str], side: str) -> dict:
    """``--set SIDE.key=value`` pairs of ``side`` as a dict (values read as YAML: ``0``, ``0.9``, ``false``)."""
    import yaml

    out = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        who, _, key = name.partition(".")
        if who not in ("yolokit", "reference") or not key or not _:
            raise SystemExit(f"--set {pair!r}: expected SIDE.key=value, SIDE yolokit or reference")
        if who == side:
            out[key] = yaml.safe_load(value)
    return out


def score(weights: Path, args: argparse.Namespace) -> dict:
    """yolokit's validation of ``weights`` on the set's val split at the preset's size."""
    import yolokit
    from yolokit.data import DetectionDataset, build_dataloader
    from yolokit.val import validate

    model = yolokit.load(str(weights)).eval().to(args.device)
    loader = build_dataloader(DetectionDataset(data_yaml(args.data), "val", imgsz=args.imgsz, rect=True,
                                               stride=max(model.strides)), 16, workers=0, shuffle=False)
    result, _ = validate(model, loader, num_classes=model.num_classes)
    out = {"mAP50": result.map50, "mAP50-95": result.map50_95, "mask_mAP50": result.mask_map50,
           "mask_mAP50-95": result.mask_map50_95}
    if getattr(model.head, "end_to_end", False):              # YOLO26: its one-to-one branch too, without NMS
        out["one-to-one mAP50-95"] = validate(model, loader, num_classes=model.num_classes, nms=False)[0].map50_95
    return out


def finished(run: Path, epochs: int) -> bool:
    """Whether ``run`` holds a whole run: its ``last.pt`` and a results.csv row for each of ``epochs`` (a run cut
    short is removed and trained again: two parity processes must not share a seed and side)."""
    results = run / "results.csv"
    if not (run / "weights" / "last.pt").is_file() or not results.is_file():
        return False
    return len(list(csv.DictReader(results.open()))) >= epochs


def run_settings(side: str, args: argparse.Namespace) -> dict:
    """What a run of ``side`` is trained with: the command's flags but those that only choose runs or where to
    write them (the seed is the folder's name), and ``side``'s own settings. A run cut short goes on only under
    the same, written to its folder as ``parity.json`` when it starts."""
    chosen = {"seeds", "sides", "out", "set", "one"}
    return {**{k: v for k, v in vars(args).items() if k not in chosen}, "set": overrides(args.set, side)}


def resumable(side: str, run: Path, args: argparse.Namespace) -> bool:
    """Whether a run cut short goes on from its checkpoint: yolokit's, started by a command of the same settings
    (its resume is exact at any step: the run is the one it would have been); the reference's starts again."""
    record = run / "parity.json"
    return side == "yolokit" and (run / "weights" / "last.pt").is_file() and record.is_file() and \
        json.loads(record.read_text()) == json.loads(json.dumps(run_settings(side, args)))


def reference_score(side: str, weights: Path, args: argparse.Namespace) -> dict | None:
    """The reference validator's mAP of ``weights`` (its own defaults); None where ultralytics does not import."""
    try:
        from ultralytics import YOLO
    except ImportError:
        return None
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from val_parity import ultralytics_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = weights
        if side == "yolokit":
            checkpoint = Path(tmp) / "reference.pt"
            ultralytics_checkpoint(str(weights), checkpoint, args.imgsz)
        out = YOLO(str(checkpoint)).val(data=str(data_yaml(args.data)), imgsz=args.imgsz, batch=16,
                                        device="cpu" if args.device == "cpu" else 0,
                                        plots=False, workers=0, verbose=False, project=tmp, name="val")
    scores = {"mAP50": float(out.box.map50), "mAP50-95": float(out.box.map)}
    if hasattr(out, "seg"):
        scores.update({"mask_mAP50": float(out.seg.map50), "mask_mAP50-95": float(out.seg.map)})
    return scores


def curve(side: str, run: Path) -> dict:
    """Per epoch mAP50 and mAP50-95 (and mask mAP50-95) as the run's own validation wrote them, and the first
    epoch (1-based) whose mAP50 reaches 0.5 (None: none did)."""
    rows = list(csv.DictReader((run / "results.csv").open()))
    rows = [{k.strip(): v for k, v in r.items()} for r in rows]
    names = {"box50": "mAP50", "box": "mAP50-95", "mask": "mask_mAP50-95"} if side == "yolokit" else \
        {"box50": "metrics/mAP50(B)", "box": "metrics/mAP50-95(B)", "mask": "metrics/mAP50-95(M)"}
    out = {key: [float(r[name]) for r in rows if name in r] for key, name in names.items()}
    out["first_50"] = next((k + 1 for k, v in enumerate(out["box50"]) if v >= 0.5), None)
    return out


def summary(values: list) -> str:
    """Mean (min-max) of the numbers in ``values`` (None left out), or "-"."""
    values = np.array([v for v in values if v is not None], float)
    if not len(values):
        return "-"
    f = ".1f" if np.all(values == values.round()) else ".3f"          # epochs: whole numbers
    return f"{values.mean():{f}} ({values.min():{f}}-{values.max():{f}})"


def table(runs: list[dict], sides: list[str]) -> list[str]:
    """A row per run, then each side's mean (min-max): yolokit's scores, the reference validator's, the first
    epoch at mAP50 0.5 (never: "-")."""
    keys = [k for k in KEYS if any(r["scores"].get(k) is not None for r in runs)]
    ref_keys = [k for k in KEYS if any((r.get("reference_val") or {}).get(k) is not None for r in runs)]
    head = keys + [f"{k} (reference val)" for k in ref_keys] + ["epoch at mAP50 0.5"]
    columns = [lambda r, k=k: r["scores"].get(k) for k in keys] + \
        [lambda r, k=k: (r.get("reference_val") or {}).get(k) for k in ref_keys] + [lambda r: r["curve"]["first_50"]]
    lines = [f"| side | seed | {' | '.join(head)} |", "|---|---|" + "---|" * len(head)]
    for r in runs:
        cells = [c(r) for c in columns]
        lines.append(f"| {r['side']} | {r['seed']} | " + " | ".join(
            "-" if v is None else (str(v) if isinstance(v, int) else f"{v:.3f}") for v in cells) + " |")
    for side in sides:
        mine = [r for r in runs if r["side"] == side]
        cells = [summary([c(r) for r in mine]) for c in columns]
        lines.append(f"| {side} | mean (min-max) | " + " | ".join(cells) + " |")
    return lines


def plot(runs: list[dict], path: Path, title: str) -> Path:
    """Every run's mAP50 and mAP50-95 per epoch (thin), each side's mean over its seeds (bold)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), constrained_layout=True)
    colours = {"yolokit": "#1f77b4", "reference": "#d62728"}
    for ax, key, label in zip(axes, ("box50", "box"), ("mAP50", "mAP50-95"), strict=True):
        for side, colour in colours.items():
            curves = [r["curve"][key] for r in runs if r["side"] == side]
            if not curves:
                continue
            for c in curves:
                ax.plot(range(1, len(c) + 1), c, color=colour, alpha=0.3, lw=0.8)
            n = min(len(c) for c in curves)
            ax.plot(range(1, n + 1), np.mean([c[:n] for c in curves], 0), color=colour, lw=2,
                    label=f"{side}: {len(curves)} seeds, mean")
        ax.set(xlabel="epoch", ylabel=label, title=f"{label}, {title}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main() -> int:
    from yolokit.cli import PRESETS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="yolov8n")
    parser.add_argument("--data", default="shapes")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--sides", nargs="+", default=["yolokit", "reference"], choices=["yolokit", "reference"])
    parser.add_argument("--out", default="runs/parity")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (both sides train and score there)")
    parser.add_argument("--set", action="append", default=[], metavar="SIDE.KEY=VALUE",
                        help="a setting of one side's trainer (an ablation), e.g. yolokit.warmup_min_steps=0")
    for k, v in PRESETS["shapes"].items():                   # the set's preset where a flag gives none
        parser.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=None)
    parser.add_argument("--one", nargs=2, metavar=("SIDE", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    for k, v in PRESETS.get(args.data, PRESETS["shapes"]).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.one:
        try:
            train_one(args.one[0], int(args.one[1]), args)
        except KeyboardInterrupt as exc:                     # Ctrl-C or SIGTERM: the command says where, once
            return getattr(exc, "exit_code", 130)            # yolokit's stop: 128 + its signal
        return 0
    missing = reference_unready() if "reference" in args.sides else []
    if missing:
        raise SystemExit(f"--sides reference: {sys.executable} cannot import {', '.join(missing)}, which the "
                         f"reference's runs need (the bench venv: pip install ultralytics==8.4.190 brings them); "
                         f"or --sides yolokit")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for seed in args.seeds:
        for side in args.sides:
            run = out / f"{side}-{seed}"
            start = time.perf_counter()
            if not finished(run, args.epochs):
                if not resumable(side, run, args):
                    shutil.rmtree(run, ignore_errors=True)       # a run cut short: from its start again
                    run.mkdir(parents=True)
                    (run / "parity.json").write_text(json.dumps(run_settings(side, args)))
                code = train_process([sys.executable, __file__, *sys.argv[1:], "--one", side, str(seed)])
                if code in (130, 143, -2, -15):                  # stopped by Ctrl-C or SIGTERM
                    again = "on from where it stopped" if resumable(side, run, args) else "from its start"
                    print(f"parity.py: stopped during {side} seed {seed}; the runs finished in {out} are kept: "
                          f"the same command scores them and trains the rest ({run.name} {again})",
                          file=sys.stderr, flush=True)
                    return 130
                if code:
                    raise SystemExit(f"parity.py: {side} seed {seed} failed (exit {code}): its output is above")
            seconds = time.perf_counter() - start
            weights = run / "weights" / "last.pt"
            threads = run / "threads.txt"
            runs.append({"side": side, "seed": seed, "seconds": round(seconds, 1), "curve": curve(side, run),
                         "threads": int(threads.read_text()) if threads.exists() else None,
                         "scores": score(weights, args), "reference_val": reference_score(side, weights, args)})
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "curve"}), flush=True)
    (out / "runs.json").write_text(json.dumps(runs, indent=1))
    lines = table(runs, args.sides)
    (out / "table.md").write_text("\n".join(lines) + "\n")
    plot(runs, out / "curves.png", f"{args.data}, {args.model}, {args.imgsz} px")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:              # between runs (while one is scored): nothing is cut short
        print("parity.py: stopped; the runs finished are kept: the same command scores them and trains the rest",
              file=sys.stderr)
        sys.exit(130)
