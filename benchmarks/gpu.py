"""The GPU pass: every measurement of the GPU pass issue, in sections run in order of priority within a budget.

    python benchmarks/gpu.py --plan                        # here: the device commands to run, in order
                                                           # (issue 41's correct-on-GPU command first)
    python benchmarks/gpu.py --all --budget 500 --out $OUT # there: the sections in order, as many as fit 500 s
    python benchmarks/gpu.py --sections mfu reference      # some sections only
    python benchmarks/gpu.py --all --cpu-smoke             # every code path on the CPU, tiny sizes, no caps

A lent GPU runs commands of at most 10 minutes, and a session gets 15 minutes of device time
(``LEASE_S``), a machine's start included. The sections' caps add up to more than one session
can hold (``CAPS``, 2,065 s), so a command takes ``--budget``: the sections run in order, each only
if its cap fits in what is left of the budget, and those that do not fit are written to the
results as ``left`` with the command that runs them (at once, if the session's device time
allows, else first thing in the next session with a GPU). ``--plan`` prints the commands with
the carried wheels of the reference (``benchmarks/gpu_wheels.py`` fetches them here, first).

Sections, in order of priority (modules in ``benchmarks/gpu/``; issue 42: what is still unknown and
decides a default first: after the 2026-12-04 pass, the launches that decide ``cuda_graphs``), each
row printed with its target; the caps (``CAPS``) are sized from the 2026-11-27 and 2026-12-04 runs:

==============  =====================================================================  ========  =====
section         what                                                                   target    cap s
==============  =====================================================================  ========  =====
tests           ``pytest -m gpu -q`` of the checkout (``--no-tests`` skips it; the     0 failed  90
                correct-on-GPU command runs it with full tracebacks)
launch          yolov8n 640 b64 bf16 from a batch on the device, eager / the whole     >= 2000   120
                step as a CUDA graph (``cuda_graphs``) / compiled / compiled with
                CUDA graphs (``compile="reduce-overhead"``) / compiled + cuda_graphs:
                img/s, the first steps' seconds (each compile, each recording)
precision       yolov8s 640 b64 img/s, the library's layout: fp32 TF32 off, fp32       >= 1.8x,  130
                (TF32 conv, PyTorch's default), bf16, fp16; bf16 and fp16 over both    >= 3x
fused           the device pass and the HSV step through torch.compile                 == eager, 80
                (``compile_augment``): compile seconds, images equal to eager, img/s    >= 8000,
                of both in turns at b64, peak memory per image, HSV ms at b64, the      <= 15 MiB,
                compiled pass's top kernels (fused-profile.txt)                        <= 1 ms
augment         augment_on="device": the batched pass (nvJPEG decode .. HSV) and the   (none)    40
                decode alone, img/s at b64; peak memory per image; loader CPU per
                image, OpenCV images / recipes
channels_last   on / off img/s, ``precision.CHANNELS_LAST_ROWS`` in order: training    (default) 120
                bf16 of yolov8s, l, yolov3, a model YAML, yolov8n; fp16; inference
batch           the trainer's batch="auto" (yolov8s, worst-case boxes) at its fraction >= 90%,   150
                and 0.95 vs the true largest batch; trials; an OOM mid-run survived    <= 8
                by the Accumulator with the same images per step
checkpointing   yolov8l and yolov3 at b32, bf16: peak memory cut, step time on / off   >= 40%,   60
                                                                                       <= 1.3x
mfu             yolov8l 640 b32 bf16 channels_last, eager and compiled: training       >= 35%    150
                FLOP/s over the measured bf16 matmul peak
loader          NVML utilisation training yolov8s (and yolov8n) from the real loader   >= 90%    75
                on every core but one; loader img/s per core vs what yolov8n eats
deploy          yolov8n fused, fp32 and fp16: ``yolokit.export(..., "pt2",             (none)    150
                device="cuda")`` (the AOTInductor compile, its check) against eager:
                batch 1 latency, batch 16 img/s
seg             yolov8s-seg and yolov8s at 640, b64 bf16: img/s of each in turns,     (none)    90
                their ratio; the seg step's peak memory
reference       step time yolokit / Ultralytics (yolov8s fp16 and bf16, yolov8n fp16,  <= 0.9   140
                yolov8s-seg bf16 with the same masks)
epoch           the trainer itself, yolov8s 640 bf16 b64 on a COCO-sized synthetic set >= 900,   200
                (118,287 images), on each augmentation path (the workers; the device,  >= 90%
                compiled): img/s, data%, GPU busy over 30 s of the epoch; the first
                scan of its labels
parity          ``benchmarks/parity.py``'s seeds 0 1 2 on both sides at a larger      (none)    500
                scale (``gpu/parity_runs.py``): yolov8s 640, 8 epochs of a 2,000-image
                shapes set, batch 32 / nbs 64: each side's mean (min-max) mAP50-95
                and mAP50 by yolokit's validation and the reference's; a command of
                its own, which resumes its runs when run again on a warm machine
==============  =====================================================================  ========  =====

Budget. The estimates assume H100 training at ~600-900 img/s for yolov8s in bf16, ~200-300
for yolov8l, ~2,000+ for yolov8n, and 1-2 minutes of torch.compile warm-up for yolov8l. A
timing is 5 warm-up rounds and 3 timed rounds of 10 steps (median), callables compared in
turns A B A B. Each section has a cap (``CAPS``), checked between measurements: once spent,
the section's remaining rows say "skipped". Every section's elapsed time is printed.

All steps are the trainer's (forward and loss under autocast, ``loss * batch`` backward,
unscale / clip 10 / SGD step without a read-back, zero grad), on synthetic batches held on
the device except in the loader and OOM sections, with the trainer's defaults on CUDA
(``yolokit.train.plan.device_settings``: cuDNN benchmark, TF32, non-deterministic kernels,
a loader worker for every core but one). The reference runs where ultralytics
imports, or in ``--reference-python``'s environment (the plan makes one from the carried
wheels); otherwise its row says "skipped: ultralytics not importable". NVML
(``nvidia-ml-py``) is optional; without it the utilisation rows say so.

The correct-on-GPU command (issue 41, ``correct_command``) comes first in the plan: before any
timing, it runs ``pytest -m gpu`` with full tracebacks, ``benchmarks/gpu/sanitize.py`` (the device
augmentation and one training step) under ``compute-sanitizer --tool memcheck`` and then
``--tool initcheck``, and the augment section 5 times, each in a fresh process (its device-side
assert came in 1 run of 2). Each step writes its file under ``$OUT`` as it runs, and its exit
status is added to ``$OUT/0-summary.txt`` when it ends.

Output, written again after every section, so a command stopped at its limit still returns
what it measured: ``gpu-results.json`` (the header, and per section its rows: value, unit,
target, ok, note, details; elapsed seconds and cap) and ``gpu-results.txt`` (the table) in
``--out`` (default ``$OUT`` when set, else ``benchmarks/``). Exit status 1 when a section
raised (its row says "error"), 2 without CUDA (unless ``--cpu-smoke``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
from gpu import augment, deploy, epoch, feeding, flops, memory, parity_runs, precision, segment, suite
from gpu.common import Clock, Row, Settings, fmt, free
from harness.timing import header

from yolokit.accel.devices import is_device_error
from yolokit.train import TrainConfig
from yolokit.train.plan import Processes, device_settings

SECTIONS = {   # in order of priority (issue 42): what is still unknown and decides a default first
    "tests": suite.gpu_tests,
    "launch": flops.launch,                   # yolov8n's launches: compile, CUDA graphs (compile="reduce-overhead")
    "precision": precision.mixed_precision,
    "fused": augment.fused_pass,              # the device pass compiled (compile_augment): decides its default
    "augment": augment.device_pass,
    "channels_last": precision.channels_last,   # its default was decided on the H200 (2.09-2.54x in training)
    "batch": memory.batch_finder,
    "checkpointing": memory.checkpointing,   # met its targets on the H100 (62.6% / 1.30x, 55.3% / 1.24x)
    "mfu": flops.mfu,
    "loader": feeding.utilisation,
    "deploy": deploy.pt2_cuda,               # issue 52: the AOTInductor .pt2 compiled for CUDA, after the rest
    "seg": segment.seg_step,                  # issue 60: yolov8s-seg's step against yolov8s's, its peak memory
    "reference": flops.reference,            # 2026-12-04 (H200): yolov8s 0.81x, yolov8n 0.99x
    "epoch": epoch.coco_epoch,               # 2026-12-04 (H200): 842 img/s (workers), 750 (device)
    "parity": parity_runs.parity,            # issue 61: parity.py's seeds at yolov8s 640, both sides; a command alone
}
# seconds, sized from the 2026-11-27 runs: precision took 73 s for 3 of its 4 rows (2026-12-04: 2 rows in 100 s),
# channels_last ~20 s a row, batch 138 s, augment 5-6 s; the reference timed out at 60 s in its own interpreter
CAPS = {"tests": 90, "reference": 140, "precision": 130, "fused": 80, "epoch": 200, "launch": 120,
        "channels_last": 120, "augment": 40, "batch": 150, "mfu": 150, "checkpointing": 60, "loader": 75,
        "deploy": 150, "seg": 90, "parity": 500}   # parity: a whole command's caps (gpu.parity_runs: 8 epochs fit)
LEASE_S = 900        # a session's device time: 15 minutes, the machine's start, idle waits and transfers included
START_S = 60         # a machine's start and the working tree's transfer (27 s seen on 2026-11-27)
SETUP_S = 40         # a command's own start: the reference's wheels, python, CUDA, the header
COMMAND_S = 600      # the most one device command may run
PASS_COMMAND_S = 510  # issue 42: the pass is one command of at most 9 minutes after the ~5 of the correct-on-GPU one
FIRST_BUDGET_S = PASS_COMMAND_S - SETUP_S   # the pass command's caps (470 s): the sections in order while they fit
WHEELS = ".whl"   # benchmarks/gpu_wheels.py fetches the reference's wheels here (ignored by git)

# Issue 41's correct-on-GPU command (correct_command), run first in the next session with a GPU.
CORRECT_LIMITS = {"tests": 150, "memcheck": 30, "initcheck": 40, "augment": 30}  # seconds each step may run
# (2026-12-04, H200: the gpu tests ran past 85 s, test_fused_pass's compile alone ~80 s; an augment run past 18 s)
# seconds from a step's SIGINT (at its limit) to its SIGKILL: compute-sanitizer prints its error summary only
# after Python has stopped, which takes a few seconds under it
KILL_AFTER = {"tests": 1, "memcheck": 5, "initcheck": 5, "augment": 1}
AUGMENT_RUNS = 3          # the augment section, each run in a fresh process: its abort came in 1 run of 2 on the
#                           H100, in none of 5 on the H200 after its fix (the tests' limit took the other two's time)
CORRECT_TIMEOUT_S = 330   # the device call's timeout_s: the steps' limits with their grace (324 s), the shell's own
SANITIZE_ARGS = "--imgsz 128 --batch 2"   # small: under compute-sanitizer every kernel runs 10-100x slower
NVJPEG_OUT = "--kernel-name-exclude kns=nvjpeg"   # initcheck: not nvJPEG's own kernels (correct_command)
INITCHECK_ARGS = SANITIZE_ARGS + " --no-step"   # the augmentation only (sanitize.NO_STEP_REASON)
SHAPES_IMAGES, SHAPES_IMGSZ = 2048, 640   # the augment section's shapes set on CUDA (gpu.common.shapes_yaml)
SHAPES_LIMIT_S = 60       # its making, in the background while the tests and sanitizers run (not added to the 324 s)


def settings(smoke: bool) -> Settings:
    if smoke:
        return Settings(torch.device("cpu"), 64, True, warmup=0, repeats=1, iters=2, workers=1)
    procs = Processes(torch.device("cuda"), rank=0, local_rank=0, world=1, local_world=1)
    speed = device_settings(TrainConfig(), procs)   # the trainer's own defaults on CUDA
    print(f"trainer defaults on CUDA: {speed.apply()}, {speed.workers} loader workers", flush=True)
    return Settings(torch.device("cuda"), 640, False, warmup=5, repeats=3, iters=10, workers=speed.workers)


def run_section(name: str, s: Settings, reference_python: str | None) -> tuple[list[Row], float]:
    """The section's rows (an "error" row if it raised) and its elapsed seconds."""
    clock = Clock(name, 1e6 if s.smoke else s.cap or CAPS[name])   # the smoke run takes every path, however slow
    print(f"\n== {name} (cap {clock.cap_s:g} s) ==", flush=True)
    try:
        if name == "reference" and reference_python:
            rows = flops.reference_elsewhere(reference_python, s, clock)
        elif name == "parity":            # both trainers' runs, by the reference's interpreter where it imports
            rows = parity_runs.parity(s, clock, reference_python)
        else:
            rows = SECTIONS[name](s, clock)
    except Exception as exc:
        traceback.print_exc()
        lost = is_device_error(exc)       # the CUDA context is lost: main() writes the results and ends there
        rows = [Row(name, "error", None, note=f"error: {type(exc).__name__}: {exc}"[:200],
                    data={"device_failed": lost})]
        if lost:
            print(f"  ({name}: the device failed after {clock.elapsed():.0f} s)", flush=True)
            return rows, clock.elapsed()
    free()
    print(f"  ({name}: {clock.elapsed():.0f} s)", flush=True)
    return rows, clock.elapsed()


def table(rows: list[Row]) -> str:
    """One line per row: section, what, value, target, pass / FAIL, note."""
    lines = [f"{'section':<14}{'measurement':<62}{'value':>11}  {'target':<9}{'result':<7}note"]
    for r in rows:
        target = "" if r.target is None else f"{r.target[0]} {fmt(r.target[1], r.unit if r.unit in 'x%' else '')}"
        result = {True: "pass", False: "FAIL", None: "-"}[r.ok]
        lines.append(f"{r.section:<14}{r.what:<62}{fmt(r.value, r.unit):>11}  {target:<9}{result:<7}{r.note}")
    return "\n".join(lines)


def default_out() -> Path:
    out = os.environ.get("OUT")
    return Path(out) if out else Path(__file__).resolve().parent


def command(names: list[str] | None, budget: int) -> str:
    """One device command: the reference's carried wheels installed, then the sections (all: None) within ``budget``."""
    which = "--all" if names is None else "--sections " + " ".join(names)
    # the reference's bytecode compiled once here (the wheels install without it): its first import in the
    # reference section's own interpreter then reads .pyc files instead of compiling ~900 modules in its time
    return (f"python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ref "
            f"{WHEELS}/*.whl && python3 -m compileall -q -j 0 /tmp/ref > /dev/null; "
            f"printf '#!/bin/sh\\nPYTHONPATH=/tmp/ref:$PYTHONPATH exec python3 \"$@\"\\n' "
            f"> /tmp/refpy && chmod +x /tmp/refpy; export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1; "
            f"python3 benchmarks/gpu.py {which} --budget {budget} --out $OUT --reference-python /tmp/refpy")


def correct_steps(limits: dict[str, int] | None = None) -> list[tuple[str, int, int]]:
    """The correct-on-GPU command's steps in order: name, seconds it may run, seconds from SIGINT to SIGKILL."""
    limits = {**CORRECT_LIMITS, **(limits or {})}
    kinds = [("1-gpu-tests", "tests"), ("2-memcheck", "memcheck"), ("3-initcheck", "initcheck")]
    kinds += [(f"4-augment-run{k}", "augment") for k in range(1, AUGMENT_RUNS + 1)]
    return [(name, limits[kind], KILL_AFTER[kind]) for name, kind in kinds]


def correct_command(limits: dict[str, int] | None = None) -> str:
    """Issue 41's correct-on-GPU command, as the device tool's ``run`` takes it (at most 2,000 characters).

    From the checkout's root on the GPU machine, with ``;`` between the steps so that one that
    fails or is stopped does not stop the others:

    1. ``pytest -m gpu -rA --tb=long`` over the files that mark tests ``gpu`` (as ``suite.py``
       picks them), its output into ``$OUT/1-gpu-tests.log`` and a JUnit report into
       ``$OUT/1-gpu-tests.xml``;
    2. ``compute-sanitizer --tool memcheck`` on ``benchmarks/gpu/sanitize.py`` into ``$OUT/2-memcheck.txt``;
    3. ``compute-sanitizer --tool initcheck`` on the same script into ``$OUT/3-initcheck.txt``;
    4. ``benchmarks/gpu.py --sections augment --no-tests`` ``AUGMENT_RUNS`` times, each in a fresh
       process, all appended to ``$OUT/4-augment-runs.txt`` between a header line and a line with
       the run's exit status (an abort is 134); their ``gpu-results`` files go to a scratch folder.

    Each step runs under ``timeout`` (``limits``, default ``CORRECT_LIMITS``): SIGINT when its time
    is up, so Python prints where it was and compute-sanitizer its summary, and SIGKILL
    ``KILL_AFTER`` seconds later. When a step ends, its exit status and seconds are added to
    ``$OUT/0-summary.txt`` (124: stopped at its limit; 99: compute-sanitizer found errors).
    Every file is written while its step runs, so a command stopped by the device tool still
    returns what it wrote; the summary's last line, "all steps ended", is missing then. Six files
    in all, directly under ``$OUT``; the device tool takes back at most 8.
    """
    steps = {name: f"{limit} {grace}" for name, limit, grace in correct_steps(limits)}
    sanitize = f"python3 benchmarks/gpu/sanitize.py {SANITIZE_ARGS}"
    # --error-exitcode: errors found show as exit 99 in the summary; --print-limit keeps the file short
    # (the error count at its end still counts every error).
    sanitizer = "compute-sanitizer --print-limit 30 --error-exitcode 99 --tool"
    # PyTorch's caching allocator keeps freed blocks and hands them out again, so a read past a tensor's
    # end or after its free lands in memory the process still owns, which memcheck cannot tell from a
    # good read; and initcheck counts a recycled block as written by its former tenant. With
    # PYTORCH_NO_CUDA_MEMORY_CACHING=1 every tensor is its own cudaMalloc, which both tools track
    # exactly. Each cudaFree then waits for the device, so these runs cannot show a race between
    # streams over reused blocks: the plain augment runs below are for that.
    uncached = "env PYTORCH_NO_CUDA_MEMORY_CACHING=1"
    # The augment section's shapes set (2,048 images at 640 px, as gpu.common.shapes_yaml has it on
    # CUDA) is made in the background while the tests run, so the first augment run does not pay
    # for it within its limit; without CUDA nothing is made (the section exits 2 there).
    shapes = ('import sys; sys.path[:0] = ["benchmarks"]; import torch; from harness.pipeline import dataset_yaml; '
              f'torch.cuda.is_available() and dataset_yaml(images={SHAPES_IMAGES}, imgsz={SHAPES_IMGSZ})')
    files = "$(grep -rlF mark.gpu tests --include='test_*.py' | sort)"   # suite.py's choice of files
    return "; ".join([
        # the checkout's library; Python's lines written as printed; compute-sanitizer where CUDA puts it
        "export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 PATH=$PATH:/usr/local/cuda/bin",
        "S=$OUT/0-summary.txt A=$OUT/4-augment-runs.txt W=$(mktemp -d)",
        'echo "correct-on-GPU command (issue 41), started $(date -u +%FT%TZ)" > $S',
        # r NAME LIMIT GRACE COMMAND...: the command under timeout (SIGINT after LIMIT seconds, SIGKILL GRACE
        # seconds later), then its exit status and seconds added to the summary
        'r() { local n=$1 l=$2 k=$3 t=$SECONDS; shift 3; timeout -k $k -s INT $l "$@"; local e=$?; '
        'echo "$n: exit $e after $((SECONDS-t)) s (limit $l s)" >> $S; return $e; }',
        f"timeout {SHAPES_LIMIT_S} python3 -c '{shapes}' > $W/shapes.log 2>&1 & G=$!",
        f"r 1-gpu-tests {steps['1-gpu-tests']} python3 -m pytest -m gpu -n 0 -rA --tb=long -p no:cacheprovider "
        f"--junitxml=$OUT/1-gpu-tests.xml {files} 2>&1 | tee $OUT/1-gpu-tests.log",
        f"r 2-memcheck {steps['2-memcheck']} {uncached} {sanitizer} memcheck {sanitize} > $OUT/2-memcheck.txt 2>&1",
        # nvJPEG's own rgba2rgb kernel reads its padding unwritten (80,512 reads on 2026-12-04, all in it; the
        # decoded images equal the workers' within a grey level): it is the library's, the check is of ours
        f"r 3-initcheck {steps['3-initcheck']} {uncached} {sanitizer.replace('--tool', NVJPEG_OUT + ' --tool')} "
        "initcheck "
        f"python3 benchmarks/gpu/sanitize.py {INITCHECK_ARGS} > $OUT/3-initcheck.txt 2>&1",
        'wait $G; echo "augment shapes set: exit $?" >> $S; tail -3 $W/shapes.log >> $S',
        f'for k in $(seq {AUGMENT_RUNS}); do echo "== augment run $k ==" >> $A; '
        f"r 4-augment-run$k {steps['4-augment-run1']} python3 benchmarks/gpu.py --sections augment --no-tests "
        '--out $W/aug$k >> $A 2>&1; echo "== augment run $k: exit $? ==" >> $A; done',
        'echo "all steps ended" >> $S; cat $S',
    ])


def fitting(names: list[str], budget: float) -> list[str]:
    """The sections, in order, that the budget's caps hold when each is run only if its cap fits what is left."""
    chosen, left = [], budget
    for name in names:
        if CAPS[name] <= left:
            chosen.append(name)
            left -= CAPS[name]
    return chosen


def plan() -> str:
    """The device commands of a session, in order, as the device tool's ``run`` takes them: the correct-on-GPU
    command (about 4 minutes), then the pass (at most 9: the sections in order while their caps fit), then
    the sections left, first in the next session after the correct-on-GPU command."""
    measured = [n for n in SECTIONS if n != "tests"]          # the correct-on-GPU command runs pytest -m gpu
    first = fitting(measured, FIRST_BUDGET_S)
    rest = [n for n in measured if n not in first]
    later = groups(rest, FIRST_BUDGET_S)
    used = START_S + CORRECT_TIMEOUT_S + PASS_COMMAND_S
    return "\n".join([
        f"# first, issue 41's correct-on-GPU command: run it with timeout_s {CORRECT_TIMEOUT_S} and carry nothing (it "
        f"needs no wheels); it writes 6 files under $OUT: 0-summary.txt (each step's exit status and seconds; 124: "
        f"stopped at its limit, 99: compute-sanitizer found errors, 134: an abort), 1-gpu-tests.log and .xml "
        f"(pytest -m gpu, full tracebacks), 2-memcheck.txt and 3-initcheck.txt (compute-sanitizer on "
        f"benchmarks/gpu/sanitize.py), 4-augment-runs.txt (the augment section {AUGMENT_RUNS} times, fresh processes)",
        correct_command(),
        "# here, once: python benchmarks/gpu_wheels.py   (the reference's wheels into .whl/, carried by the pass)",
        f"# then the pass, at once while the machine is warm: timeout_s {PASS_COMMAND_S}, carry [\"{WHEELS}\"]; the "
        f"sections in order while their caps fit {FIRST_BUDGET_S} s ({', '.join(first)}); a session of {LEASE_S} s "
        f"holds a start (~{START_S} s), the command above and this one: {used} s",
        command(first, FIRST_BUDGET_S),
        f"# the sections left (caps {sum(CAPS[n] for n in rest)} s), in {len(later)} command(s) of at most "
        f"{FIRST_BUDGET_S} s of caps: first in the next sessions with a GPU, each after the correct-on-GPU command "
        f"(the sections gpu-results.json lists as \"left\")",
        *[command(group, sum(CAPS[n] for n in group)) for group in later],
        *([f"# parity (issue 61; gpu/parity_runs.py): timeout_s {COMMAND_S}, its runs' grace after the cap; its runs "
           f"stay in runs/gpu-parity on the machine, so while gpu-results.json says runs are left, the same command "
           f"again (warm machine) trains only those"] if "parity" in rest else []),
    ])


def groups(names: list[str], budget: float) -> list[list[str]]:
    """``names`` cut into commands whose caps each fit ``budget``, in order of priority."""
    out = []
    while names:
        group = fitting(names, budget) or names[:1]
        out.append(group)
        names = [n for n in names if n not in group]
    return out


def write_results(folder: Path, described: str, s: Settings, sections: dict, rows: list[Row], total: float,
                  left: list[str]) -> Path:
    """``gpu-results.json`` and ``gpu-results.txt`` (the table) in ``folder``, with every section so far
    and the sections ``left`` for the next command (their caps did not fit the budget)."""
    folder.mkdir(parents=True, exist_ok=True)
    out = {**dict(line.split(": ", 1) for line in described.splitlines()), "settings": vars(s).copy(),
           "total_s": total, "sections": sections, "left": left}
    (folder / "gpu-results.json").write_text(json.dumps(out, indent=1, default=str))
    (folder / "gpu-results.txt").write_text(f"{described}\n\n{table(rows)}\n")
    return folder / "gpu-results.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true", help="every section, in order (the default)")
    which.add_argument("--sections", nargs="+", choices=list(SECTIONS), help="these sections only")
    which.add_argument("--plan", action="store_true", help="print the device commands of the pass and exit")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds of caps this command may spend: a section runs only if its cap fits what is "
                             "left, the others are listed as left for the next command")
    parser.add_argument("--no-tests", action="store_true", help="skip the pytest -m gpu run")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder of gpu-results.json and .txt, written after every section (default: $OUT)")
    parser.add_argument("--reference-python", default=None,
                        help="interpreter of an environment where ultralytics imports, for the reference section")
    parser.add_argument("--cap", type=float, default=None,
                        help="seconds each section may run, instead of its CAPS entry (the reference section's own "
                             "interpreter gets what is left of the section's cap)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="every code path on the CPU at 64 px, batch 2, 2 steps, no compile (numbers meaningless)")
    args = parser.parse_args(argv)
    if args.plan:
        print(plan())
        return 0
    if not args.cpu_smoke and not torch.cuda.is_available():
        print(f"benchmarks/gpu.py needs a CUDA GPU, and torch.cuda.is_available() is False here "
              f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}); "
              f"--cpu-smoke runs its code paths on the CPU.", file=sys.stderr)
        return 2
    names = [n for n in SECTIONS if n in (args.sections or SECTIONS)]   # in order of priority
    names = [n for n in names if not (args.no_tests and n == "tests")]
    s = dataclasses.replace(settings(args.cpu_smoke), out=args.out or default_out(), cap=args.cap)
    described = header({"ultralytics": flops.reference_version() or "not importable"})
    print(described)
    folder = args.out or default_out()
    start, rows, sections, left, spent = time.perf_counter(), [], {}, [], 0.0
    path = write_results(folder, described, s, sections, rows, 0.0, left)
    for name in names:
        # the sections' own seconds against the budget: a command whose budget is its sections' caps (the plan's,
        # the one printed for those left) runs its last one while the others stayed within theirs
        if args.budget is not None and spent + CAPS[name] > args.budget:
            left.append(name)   # its cap does not fit what is left of the budget: the next command's
            print(f"\n== {name}: left for the next command (cap {CAPS[name]} s; "
                  f"{max(0.0, args.budget - spent):.0f} s of the budget left) ==", flush=True)
            continue
        got, elapsed = run_section(name, s, args.reference_python)
        spent += elapsed
        rows += got
        sections[name] = {"elapsed_s": elapsed, "cap_s": CAPS[name], "rows": [r.as_dict() for r in got]}
        if (got[0].data or {}).get("device_failed"):    # a CUDA error: nothing more can run in this process
            left += [n for n in names[names.index(name) + 1:] if n not in left]
            path = write_results(folder, described, s, sections, rows, time.perf_counter() - start, left)
            print(f"the device failed in section {name}: {got[0].note}\nresults written to {path}; the sections "
                  f"left ({', '.join(left) or 'none'}) need a new process; exiting now (1), before the CUDA "
                  f"context's teardown can abort it", flush=True)
            os._exit(1)
        path = write_results(folder, described, s, sections, rows, time.perf_counter() - start, left)
    total = time.perf_counter() - start
    path = write_results(folder, described, s, sections, rows, total, left)
    print(f"\n== GPU pass: {len(rows)} rows in {total / 60:.1f} minutes "
          f"({sum(r.ok is True for r in rows)} pass, {sum(r.ok is False for r in rows)} FAIL) ==")
    print(table(rows))
    print(f"results written to {path} and {path.with_suffix('.txt')}")
    if left:
        print(f"left for the next command ({', '.join(left)}; caps {sum(CAPS[n] for n in left)} s), with budget "
              f"= the session's budget_left_s - {SETUP_S + 60} (or the caps, in a new session):\n"
              f"{command(left, sum(CAPS[n] for n in left))}")
    return 1 if any(r.what == "error" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
