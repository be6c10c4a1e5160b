"""Both trainers at a larger scale (issue 61): ``benchmarks/parity.py``'s seeds with yolov8s at 640 px on a
2,000-image shapes set, yolokit's side and the reference's (Ultralytics), every final weight scored by both
validators.

Each run is a call of its own of ``parity.py`` (``--seeds S --sides SIDE``) by an interpreter where both
yolokit and ultralytics import (``--reference-python``, else this one where ultralytics imports; else
yolokit's side alone, and the rows say the reference was skipped), so the section's clock is checked
between runs: a run starts only while its estimate fits what is left of the cap, and one still running
at the cap (plus ``GRACE_S``) is stopped and its folder removed. The runs are kept in ``runs/gpu-parity/``
of the checkout (ignored by git; a warm machine keeps them between commands), each finished one with its
record (``parity-run.json``) beside its weights: the same command again trains only the runs not finished
(``parity.py`` alone would take a run cut short, whose ``last.pt`` is there, for a finished one).

Only the summary goes to ``--out``: ``parity/table.md`` (a row per run and each side's mean (min-max)),
``parity/runs.json``, ``parity/curves.png`` (``parity.py``'s own table and plot) and ``parity/parity.log``
(the runs' console): the device tool takes back at most 8 files, 2 folders down, and the runs' weights
would be far more.

The GPU machine has no polars, which Ultralytics' trainer imports (only to copy ``results.csv`` into every
checkpoint: ``BaseTrainer.read_results_csv``, its read inside a try); where it does not import, the
reference's runs get a stand-in module (``POLARS_STANDIN``) whose read fails, so the checkpoints hold no
copy of the CSV. The CPU smoke run (``--cpu-smoke``) takes the same path at tiny sizes: 8 training images at
64 px, 1 epoch, 1 seed, the tests' tiny model on yolokit's side alone (yolov8n on both sides where the
reference imports: the reference needs a model name of its own).
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpu.common import Clock, Row, Settings

ROOT = Path(__file__).resolve().parents[2]
PARITY = ROOT / "benchmarks" / "parity.py"
TINY = ROOT / "tests" / "fixtures" / "tiny.yaml"    # the tests' tiny detector (tests/_models.py: TINY)
RUNS = ROOT / "runs" / "gpu-parity"                  # the GPU runs, kept between commands on a warm machine

MODEL, IMGSZ, TRAIN_IMAGES, VAL_IMAGES = "yolov8s", 640, 2000, 200
SEEDS = (0, 1, 2)                                     # the CPU runs' seeds (BENCHMARKS.md)
BATCH, NBS, WARMUP_EPOCHS, CLOSE_MOSAIC = 32, 64, 1.0, 2

# Epochs sized to the section's cap (gpu.CAPS["parity"], 500 s: all one command of the plan may spend) on an
# H200, where yolov8s at 640 trains at ~600 img/s and validates at ~1,000 img/s on both sides (assumed):
#   an epoch: 2,000 / 600 = 3.3 s of training + 200 / 1,000 = 0.2 s of validation + ~1 s at its end
#     (checkpoint, the loader's workers) = 4.5 s;
#   a run: ~25 s of starts (parity.py's process ~5 s, then the training process's ~20 s: python, torch,
#     CUDA, the model, the workers) + E epochs + ~10 s of scoring (both validators, their model loads)
#     = 35 + 4.5 E s;
#   the section: ~30 s for the set (2,200 images at 640, made once and cached) + ~5 s to ask the
#     reference's interpreter what imports + 3 seeds x 2 sides: 35 + 6 x (35 + 4.5 E) = 245 + 27.2 E s,
#     within 500 s with room for the estimates' error: E = 8 (463 s, 37 s to spare; E = 9: 490 s, 10 s).
EPOCHS = 8
TRAIN_RATE, VAL_RATE = 600.0, 1000.0                 # img/s, yolov8s at 640 on the H200 (assumed)
RUN_START_S, EPOCH_END_S, SCORE_S, SET_S, PROBE_S = 25.0, 1.0, 10.0, 30.0, 5.0
PROGRESS = re.compile(r"\d+%\|")   # a progress bar's line (tqdm's, both trainers'), which the console goes without
GRACE_S = 20.0   # a run still going at the cap may go on this long: its command (timeout_s 600) holds the
#                  setup (gpu.SETUP_S, 40 s), the cap (500 s) and this

POLARS_STANDIN = '''"""A stand-in for polars where it is not installed (benchmarks/gpu/parity_runs.py): Ultralytics'
trainer imports it only to copy results.csv into each checkpoint, its read inside a try, which then holds {}."""


def read_csv(*args, **kwargs):
    raise ImportError("polars is not installed here (a stand-in)")
'''
PROBE = ("import importlib.util, json\n"
         "def version(name):\n"
         "    try:\n"
         "        return str(__import__(name).__version__)\n"
         "    except Exception:\n"
         "        return None\n"
         "print(json.dumps({'ultralytics': version('ultralytics'), 'yolokit': version('yolokit'),\n"
         "                  'polars': importlib.util.find_spec('polars') is not None}))")


def run_estimate_s(epochs: int = EPOCHS) -> float:
    """Seconds one GPU run of ``epochs`` takes by the estimate above: starts, epochs, scoring."""
    return RUN_START_S + epochs * (TRAIN_IMAGES / TRAIN_RATE + VAL_IMAGES / VAL_RATE + EPOCH_END_S) + SCORE_S


def estimate_s(epochs: int = EPOCHS, runs: int = 2 * len(SEEDS)) -> float:
    """Seconds the whole GPU section takes by the estimate: the set, the probe, ``runs`` runs."""
    return SET_S + PROBE_S + runs * run_estimate_s(epochs)


@dataclass(frozen=True)
class Plan:
    """What this call runs: the model, the set's sizes, the schedule, the seeds, where."""

    model: str
    imgsz: int
    train_images: int
    val_images: int
    epochs: int
    batch: int
    nbs: int
    seeds: tuple[int, ...]
    device: str
    workers: int
    runs: Path      # the runs' folder (resumed)
    out: Path       # the summary's folder (under --out)

    def args(self, data: Path) -> list[str]:
        """``parity.py``'s flags common to every run."""
        return ["--model", self.model, "--data", str(data), "--imgsz", str(self.imgsz), "--device", self.device,
                "--epochs", str(self.epochs), "--batch", str(self.batch), "--nbs", str(self.nbs),
                "--warmup-epochs", str(WARMUP_EPOCHS), "--close-mosaic", str(CLOSE_MOSAIC),
                "--workers", str(self.workers), "--out", str(self.runs)]


def plan(s: Settings, reference: bool) -> Plan:
    """The GPU's sizes, or the smoke run's (the tiny model on yolokit's side alone unless the reference runs)."""
    out = Path(s.out or ROOT / "benchmarks") / "parity"
    if s.smoke:
        return Plan("yolov8n" if reference else str(TINY), s.imgsz, 8, 4, 1, s.batch(BATCH), s.batch(NBS), SEEDS[:1],
                    "cpu", 0, out / "runs", out)
    tag = f"{MODEL}-{IMGSZ}-n{TRAIN_IMAGES}-v{VAL_IMAGES}-e{EPOCHS}-b{BATCH}"
    return Plan(MODEL, IMGSZ, TRAIN_IMAGES, VAL_IMAGES, EPOCHS, BATCH, NBS, SEEDS, "cuda", s.workers or 8,
                RUNS / tag, out)


def environment(extra: list[Path] = ()) -> dict[str, str]:
    """This process's environment with the checkout's ``src`` (and ``extra`` folders) first on PYTHONPATH."""
    paths = [str(p) for p in (*extra, ROOT / "src")] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}


def probe(python: str) -> dict:
    """What imports in ``python``: ultralytics' and yolokit's versions (None: not importable), polars (bool)."""
    if python == sys.executable:
        import importlib.util

        from harness.reference import version

        import yolokit
        return {"ultralytics": version(), "yolokit": yolokit.__version__,
                "polars": importlib.util.find_spec("polars") is not None}
    try:
        done = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=120,
                              env=environment())
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        print(f"  {python}: {type(exc).__name__}: {exc}", flush=True)
        return {"ultralytics": None, "yolokit": None, "polars": False}


def interpreter(reference_python: str | None) -> tuple[str, dict, str]:
    """The interpreter of the runs, what imports there, and why the reference is skipped ("": it runs):
    ``reference_python``, else this one, the first where both yolokit and ultralytics import."""
    tried = []
    for python in [p for p in (reference_python, sys.executable) if p]:
        found = probe(python)
        print(f"  {python}: ultralytics {found['ultralytics'] or 'not importable'}, yolokit "
              f"{found['yolokit'] or 'not importable'}, polars {'importable' if found['polars'] else 'not importable'}",
              flush=True)
        if found["ultralytics"] and found["yolokit"]:
            return python, found, ""
        tried.append(python)
    return sys.executable, {"ultralytics": None, "yolokit": "", "polars": False}, \
        f"skipped: ultralytics not importable in {' or '.join(tried)} (yolokit's side alone)"


def finished(run: Path, epochs: int) -> bool:
    """Whether ``run`` trained all its epochs: its ``last.pt``, and a row of ``results.csv`` per epoch."""
    if not (run / "weights" / "last.pt").is_file() or not (run / "results.csv").is_file():
        return False
    with (run / "results.csv").open() as f:
        return sum(1 for _ in csv.DictReader(f)) >= epochs


def record(run: Path, epochs: int) -> dict | None:
    """The run's record from an earlier call (``parity-run.json``), if the run is finished."""
    path = run / "parity-run.json"
    if not (path.is_file() and finished(run, epochs)):
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None


def call(cmd: list[str], env: dict, limit: float, log, cwd: Path) -> tuple[int, float, list[str]]:
    """``cmd`` in ``cwd``, in a process group of its own (its training process too), its console streamed into
    ``log`` and, but for progress bars, into this one's (prefixed ``  | ``), killed with its group after ``limit``
    seconds: exit status (negative: killed), seconds, its last lines. (In ``cwd``: what a trainer writes beside
    itself, as the reference's MLflow database where mlflow imports, stays out of the checkout.)"""
    started, lines = time.perf_counter(), []
    # a process group of its own, in this session (no setsid): the device tool ends what a command leaves running
    # unless it started a session of its own
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          cwd=cwd, preexec_fn=os.setpgrp) as child:

        def kill() -> None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)

        timer = threading.Timer(limit, kill)
        timer.start()
        try:
            for line in child.stdout:
                log.write(line)
                if not PROGRESS.search(line):         # progress bars: in the log only
                    lines = [*lines[-20:], line.rstrip("\n")]
                    print(f"  | {lines[-1]}", flush=True)
        except BaseException:           # this process stopped (a KeyboardInterrupt): its runs with it
            kill()
            raise
        finally:
            timer.cancel()
            log.flush()
        code = child.wait()
    return code, time.perf_counter() - started, lines


def summary(values: list[float]) -> tuple[float | None, str, dict]:
    """Mean, its note ("min-max a-b of n seeds") and the numbers, of ``values`` (None left out)."""
    values = [v for v in values if v is not None]
    if not values:
        return None, "", {}
    a = np.array(values, float)
    return float(a.mean()), f"min-max {a.min():.3f}-{a.max():.3f} of {len(a)} seed(s)", \
        {"min": float(a.min()), "max": float(a.max()), "n": len(a)}


def rows_of(records: list[dict], sides: list[str], why: dict[str, str], p: Plan, note: str) -> list[Row]:
    """Per side the mean (min-max) of mAP50-95 and mAP50 by yolokit's validation, and mAP50-95 by the reference
    validator's where it scored (a side without runs: ``why``); yolokit's mean less the reference's; the runs
    finished, and where the files are."""
    rows, means = [], {}
    for side in ("yolokit", "reference"):
        mine = [r for r in records if r["side"] == side]
        seeds = [r["seed"] for r in mine]
        if not mine:
            rows.append(Row("parity", f"{side} mAP50-95 (yolokit val), mean over seeds", None,
                            note=why.get(side) or "no run finished (left at the cap)"))
            continue
        for key in ("mAP50-95", "mAP50"):
            values = [r["scores"].get(key) for r in mine]
            mean, spread, data = summary(values)
            means[side, key] = mean
            rows.append(Row("parity", f"{side} {key} (yolokit val), mean over seeds", mean, note=spread,
                            data={**data, "per_seed": dict(zip(seeds, values, strict=True)),
                                  "seconds": {r["seed"]: r.get("seconds") for r in mine}}))
        ref = [(r.get("reference_val") or {}) for r in mine]
        mean, spread, data = summary([v.get("mAP50-95") for v in ref])
        mean50 = summary([v.get("mAP50") for v in ref])[0]
        rows.append(Row("parity", f"{side} mAP50-95 (reference val), mean over seeds", mean,
                        note=(f"{spread}; mAP50 {mean50:.3f}" if mean is not None else
                              "the reference validator did not score (ultralytics not importable in the runs)"),
                        data={**data, "per_seed": dict(zip(seeds, [v.get("mAP50-95") for v in ref], strict=True))}))
    if ("reference", "mAP50-95") in means and ("yolokit", "mAP50-95") in means:
        rows.append(Row("parity", "mAP50-95 yolokit - reference (yolokit val), means", means["yolokit", "mAP50-95"]
                        - means["reference", "mAP50-95"], note="each side's mean over the seeds it finished"))
    total = len(p.seeds) * len(sides)
    rows.append(Row("parity", "runs finished", float(len(records)),
                    note=f"of {total} ({p.model if p.model != str(TINY) else 'tiny.yaml'} {p.imgsz} px, "
                         f"{p.train_images} images, {p.epochs} epoch(s)){note}; table.md, curves.png in {p.out}",
                    data={"total": total, "sides": sides, "seeds": list(p.seeds), "epochs": p.epochs,
                          "runs_folder": str(p.runs), "out": str(p.out)}))
    return rows


def write_summary(records: list[dict], sides: list[str], p: Plan) -> None:
    """``runs.json``, ``table.md`` and ``curves.png`` of the runs so far, by ``parity.py``'s own table and plot."""
    import parity

    p.out.mkdir(parents=True, exist_ok=True)
    (p.out / "runs.json").write_text(json.dumps(records, indent=1))
    present = [side for side in sides if any(r["side"] == side for r in records)]
    (p.out / "table.md").write_text("\n".join(parity.table(records, present)) + "\n")
    parity.plot(records, p.out / "curves.png", f"shapes {p.train_images}, {Path(p.model).stem}, {p.imgsz} px")


def parity(s: Settings, clock: Clock, reference_python: str | None = None) -> list[Row]:
    """The seeds of both sides at yolov8s 640 (tiny on the CPU), run by run while the cap holds: each side's
    mean (min-max) of mAP50-95 and mAP50 over its seeds, scored by yolokit's validation and the reference's."""
    from yolokit.data import make_shapes

    python, found, skip = interpreter(reference_python)
    p = plan(s, reference=not skip)
    sides = ["yolokit"] if skip else ["yolokit", "reference"]
    data = make_shapes(n_train=p.train_images, n_val=p.val_images, imgsz=p.imgsz, seed=0)
    print(f"  {p.model} at {p.imgsz} px, {p.epochs} epoch(s), seeds {' '.join(map(str, p.seeds))}, "
          f"sides {' '.join(sides)}, by {python}; the set {data}; the runs in {p.runs} "
          f"({clock.elapsed():.0f} s so far)", flush=True)
    env = environment()
    if not skip and not found["polars"]:       # Ultralytics' trainer imports it (read_results_csv)
        standin = p.runs.parent / "polars-standin"
        (standin / "polars").mkdir(parents=True, exist_ok=True)
        (standin / "polars" / "__init__.py").write_text(POLARS_STANDIN)
        env = {"yolokit": env, "reference": environment([standin])}
    else:
        env = {"yolokit": env, "reference": env}
    p.runs.mkdir(parents=True, exist_ok=True)
    p.out.mkdir(parents=True, exist_ok=True)
    records, left, failed, taken, stopped = [], [], {}, [], False
    with (p.out / "parity.log").open("w") as log:
        for seed in p.seeds:
            for side in sides:
                run = p.runs / f"{side}-{seed}"
                done = record(run, p.epochs)
                if done is not None:
                    print(f"  {side} seed {seed}: finished in an earlier call", flush=True)
                    records.append(done)
                    continue
                if side in failed:               # its side failed once: it would again
                    continue
                estimate = max([run_estimate_s(p.epochs) if s.cuda else 0.0, *taken])
                if stopped or clock.elapsed() + estimate > clock.cap_s:
                    left.append(f"{side}-{seed}")
                    continue
                if run.exists() and not finished(run, p.epochs):   # cut short in an earlier call: trained again
                    shutil.rmtree(run)
                limit = max(30.0, clock.cap_s - clock.elapsed()) + GRACE_S
                log.write(f"== {side} seed {seed} ==\n")
                code, seconds, lines = call([python, "-u", str(PARITY), *p.args(data), "--seeds", str(seed),
                                             "--sides", side], env[side], limit, log, p.runs)
                taken.append(seconds)
                got = json.loads((p.runs / "runs.json").read_text()) if code == 0 else []
                got = [r for r in got if (r["side"], r["seed"]) == (side, seed)]
                if not got:
                    if not finished(run, p.epochs):
                        shutil.rmtree(run, ignore_errors=True)   # a later call trains it again
                    if code < 0:                                 # stopped at the cap: left, as the rest
                        stopped = True
                        left.append(f"{side}-{seed}")
                        print(f"  {side} seed {seed}: stopped at the cap after {seconds:.0f} s", flush=True)
                        continue
                    failed[side] = f"{side} seed {seed}: exit {code}: {' / '.join(lines[-3:])[-200:]}"
                    print(f"  {failed[side]}", flush=True)
                    continue
                got[0]["call_seconds"] = round(seconds, 1)
                (run / "parity-run.json").write_text(json.dumps(got[0]))
                records.append(got[0])
                write_summary(records, sides, p)
    if records:
        write_summary(records, sides, p)
    note = "".join([f"; left at the cap: {' '.join(left)} (the same command again resumes them)" if left else "",
                    *[f"; failed: {why}" for why in failed.values()],
                    f"; reference {found['ultralytics']}" if not skip else ""])
    why = {**{side: f"failed: {text}" for side, text in failed.items()}, **({"reference": skip} if skip else {})}
    return rows_of(records, sides, why, p, note)
