"""The demo's epoch split into its parts, for one commit or several side by side.

    python benchmarks/demo_split.py                                   # this checkout, the demo's 25 epochs
    python benchmarks/demo_split.py --commits a2b76d0 HEAD --rounds 2 --epochs 6

Each run is `yolokit train`'s demo (the shapes preset: yolov8n, 256 px, batch 16, nbs 16, warmup 1 epoch,
close_mosaic 5, 2 workers, plots on) in a process of its own, with timers around the trainer's parts, found
by name at each commit (the trainer's layout changed since the first ones: a part a commit has no function
for reads "-", and its time stays in "the rest"):

- ``data wait``: the training loop waiting on the loader (``next`` of ``loader_batches``);
- ``steps``: ``train_step`` (forward, loss, backward, optimizer, EMA), and inside it ``forward+backward``;
- ``ema``: ``ModelEMA.update``;
- ``meter reads`` and ``per-step checks`` (``Trainer.agree``: the signal / watchdog / time exchange);
- ``validation`` (``validate`` as the trainer calls it);
- ``checkpoints``: ``WeightsFolder.save_epoch`` and ``save_position``, or ``atomic_save`` where the trainer
  calls it itself;
- ``callbacks: Class.hook``: every method of ``yolokit.train.callbacks``' ``ProgressBar``, ``CSVLogger``
  and ``Plotter`` (the bar; results.csv; the plots);
- ``the rest``: the run's time (setup, the workers' start, the steps where no timer sits) less the parts
  that do not nest in another.

With ``--commits`` every commit is checked out once into a temporary worktree (``git worktree add``) and
the runs alternate A B B A ... (``--rounds``), so that a slow minute of a shared machine falls on both.
Prints per commit the seconds per epoch of each part (the run's total over its epochs, the first epoch's
workers' start included) and writes ``--json``. Time it alone on the machine.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESET = dict(model="yolov8n", data="shapes", epochs=25, imgsz=256, batch=16, nbs=16, warmup_epochs=1.0,
              close_mosaic=5, workers=2, plots=True)
# (part, module, attribute): a function of a module (as the trainer's module calls it), or Class.method;
# parts marked nested are inside "steps" and are not taken from "the rest"
TARGETS = [
    ("steps", "yolokit.train.trainer", "train_step"),
    ("forward+backward", "yolokit.train.step", "forward_backward"),
    ("ema", "yolokit.train.ema", "ModelEMA.update"),
    ("meter reads", "yolokit.train.trainer", "Trainer.read_meter"),
    ("per-step checks", "yolokit.train.trainer", "Trainer.agree"),
    ("validation", "yolokit.train.trainer", "validate"),
    ("checkpoints", "yolokit.train.checkpoint", "WeightsFolder.save_epoch"),
    ("checkpoints", "yolokit.train.checkpoint", "WeightsFolder.save_position"),
    ("checkpoints", "yolokit.train.trainer", "atomic_save"),
]
NESTED = {"forward+backward", "ema"}       # inside steps (or, at commits without train_step, in the rest)
CALLBACKS = ("ProgressBar", "CSVLogger", "Plotter")


class Timers:
    """Seconds per part over the run; a part entered again inside itself is counted once."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.active: set[str] = set()

    def wrap(self, part: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if part in self.active:               # save_epoch calling save_position: once
                return fn(*args, **kwargs)
            self.active.add(part)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start
                self.active.discard(part)
        return timed

    def wrap_batches(self, loader_batches):
        @functools.wraps(loader_batches)
        def timed(*args, **kwargs):
            batches = loader_batches(*args, **kwargs)
            while True:
                start = time.perf_counter()
                try:
                    batch = next(batches)
                except StopIteration:
                    self.seconds["data wait"] += time.perf_counter() - start
                    return
                self.seconds["data wait"] += time.perf_counter() - start
                yield batch
        return timed


def install(timers: Timers) -> list[str]:
    """The timers in place; returns the parts this commit has no function for."""
    found = set()
    for part, module_name, attribute in TARGETS:
        try:
            module = importlib.import_module(module_name)
            owner_name, _, name = attribute.rpartition(".")
            owner = getattr(module, owner_name) if owner_name else module
            setattr(owner, name, timers.wrap(part, getattr(owner, name)))
            found.add(part)
        except (ImportError, AttributeError):
            pass
    callbacks = importlib.import_module("yolokit.train.callbacks")
    for class_name in CALLBACKS:
        cls = getattr(callbacks, class_name, None)
        for name in [n for n in vars(cls) if n.startswith("on_")] if cls is not None else []:
            setattr(cls, name, timers.wrap(f"callbacks: {class_name}.{name}", getattr(cls, name)))
    trainer = importlib.import_module("yolokit.train.trainer")
    if hasattr(trainer, "loader_batches"):
        trainer.loader_batches = timers.wrap_batches(trainer.loader_batches)
        found.add("data wait")
    return sorted(({p for p, _, _ in TARGETS} | {"data wait"}) - found)


def one(args: argparse.Namespace) -> int:
    """One run in this process (the yolokit on ``sys.path``): the per-epoch seconds of each part as JSON."""
    from yolokit.data import make_shapes
    from yolokit.train import TrainConfig, train

    timers = Timers()
    missing = install(timers)
    import dataclasses

    import yolokit

    config = {**PRESET, "epochs": args.epochs, "imgsz": args.imgsz, "data": str(make_shapes()), "out": args.out,
              "verbose": False}
    fields = {f.name for f in dataclasses.fields(TrainConfig)}              # an older commit: its own fields
    start = time.perf_counter()
    train(TrainConfig(**{k: v for k, v in config.items() if k in fields}))
    total = time.perf_counter() - start
    parts = {k: round(v, 4) for k, v in timers.seconds.items()}
    parts["the rest"] = round(total - sum(v for k, v in parts.items() if k not in NESTED), 4)
    print("SPLIT " + json.dumps({"total": round(total, 2), "epochs": args.epochs, "missing": missing,
                                 "parts": parts, "source": yolokit.__file__}), flush=True)
    return 0


def worktree(commit: str, where: Path) -> Path:
    """``commit`` checked out at ``where`` (a detached worktree of this repository)."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--force", str(where), commit],
                   check=True, capture_output=True)
    return where


def run(src: Path, epochs: int, imgsz: int, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, __file__, "--one", "--epochs", str(epochs), "--imgsz", str(imgsz),
                           "--out", str(out)], env=env, capture_output=True, text=True)
    line = next((x for x in done.stdout.splitlines() if x.startswith("SPLIT ")), None)
    if done.returncode or line is None:
        raise SystemExit(f"the run from {src} failed:\n{done.stderr[-3000:]}")
    result = json.loads(line[len("SPLIT "):])
    if not Path(result["source"]).resolve().is_relative_to(src.resolve()):
        raise SystemExit(f"the run meant for {src} imported yolokit from {result['source']}")
    return result


def summary(results: list[dict]) -> dict[str, float]:
    """Seconds per epoch of each part, the mean over the runs; ``epoch``: the run's total over its epochs."""
    sums: dict[str, float] = defaultdict(float)
    for r in results:
        sums["epoch"] += r["total"] / r["epochs"]
        for k, v in r["parts"].items():
            sums[k] += v / r["epochs"]
    return {k: v / len(results) for k, v in sums.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commits", nargs="+", help="commits to time side by side (default: this checkout)")
    parser.add_argument("--rounds", type=int, default=1, help="runs per commit, alternating")
    parser.add_argument("--epochs", type=int, default=PRESET["epochs"])
    parser.add_argument("--imgsz", type=int, default=PRESET["imgsz"], help="the demo's 256 (smaller: a smoke run)")
    parser.add_argument("--out", default=None, help="the runs' folder (default: a temporary one)")
    parser.add_argument("--json", help="write the split here")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        return one(args)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from harness.timing import header

    print(header(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sources = {"checkout": ROOT / "src"}
        if args.commits:
            sources = {c: worktree(c, tmp / f"tree-{k}") / "src" for k, c in enumerate(args.commits)}
        results: dict[str, list[dict]] = {name: [] for name in sources}
        try:
            for r in range(args.rounds):
                order = list(sources) if r % 2 == 0 else list(reversed(sources))   # A B, then B A
                for name in order:
                    out = Path(args.out or tmp) / f"{name}-{r}"
                    results[name].append(run(sources[name], args.epochs, args.imgsz, out))
                    print(f"{name} round {r + 1}: {results[name][-1]['total']:.1f} s", flush=True)
        finally:
            if args.commits:
                for k in range(len(args.commits)):
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tmp / f"tree-{k}")],
                                   capture_output=True)
    means = {name: summary(rs) for name, rs in results.items()}
    parts = sorted({p for m in means.values() for p in m}, key=lambda p: (p != "epoch", p == "the rest",
                                                                       p.startswith("callbacks"), p))
    print(f"\n| seconds per epoch | {' | '.join(means)} |\n|---|" + "---:|" * len(means))
    for part in parts:
        print(f"| {part} | " + " | ".join(f"{means[n][part]:.3f}" if part in means[n] else "-" for n in means)
              + " |")
    for name, rs in results.items():
        if rs and rs[0]["missing"]:
            print(f"{name}: no timer for {', '.join(rs[0]['missing'])} (not in that commit)")
    if args.json:
        Path(args.json).write_text(json.dumps({"means": means, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
