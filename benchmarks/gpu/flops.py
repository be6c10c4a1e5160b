"""Model FLOPs utilisation of yolov8l training, and yolokit's step time against the reference's."""

from __future__ import annotations

import json
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from harness import inputs
from harness.timing import alternate, median

from gpu.common import BOXES, Clock, Row, Settings, TrainStep, attempt, free, images_per_second

REFERENCE_START_S = 30   # the reference interpreter's own start: python, torch, CUDA, ultralytics' import

MFU_FLOOR = 35.0  # %: issue 42 (the first H100 pass: 24.6% eager, 25.9% compiled)
LAUNCH_FLOOR = 2000.0   # img/s: issue 42, yolov8n bf16 b64 from batches on the device (589 on the H100)
RATIO = 0.9       # issue 16: yolokit's step time / Ultralytics' <= 0.9


def matmul_peak(s: Settings) -> float:
    """Measured dense bf16 matmul FLOP/s of the device (8192^3 on the GPU)."""
    n, iters = (8192, 50) if s.cuda else (256, 2)
    a = torch.randn(n, n, device=s.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=s.device, dtype=torch.bfloat16)
    seconds = median(alternate([lambda: a @ b], warmup=5, repeats=3, inner=iters, device=s.device)[0])
    return 2 * n**3 / seconds


def mfu(s: Settings, clock: Clock) -> list[Row]:
    """yolov8l at 640, batch 32, bf16, channels_last: training FLOPs of one step (forward and
    backward, ``torch.utils.flop_counter``) times steps/s over the matmul peak; eager and compiled."""
    from torch.utils.flop_counter import FlopCounterMode

    name, batch = "yolov8l", s.batch(32)
    peak = matmul_peak(s)
    step = TrainStep(s, name, batch, "bf16", channels_last=True)
    step()
    with FlopCounterMode(display=False) as counter:
        step()
    flops = counter.get_total_flops()
    print(f"  bf16 matmul peak {peak / 1e12:.1f} TFLOP/s; {name} {flops / batch / 1e9:.1f} GFLOP per image "
          f"per training step", flush=True)
    rows, best = [], None
    for compiled in (False, True):
        what = f"{name} MFU, bf16 channels_last{', compiled' if compiled else ''}"
        if compiled and s.smoke:
            rows.append(Row("mfu", what, None, "%", note="skipped: no compile in the smoke run"))
            continue
        if clock.over():
            rows.append(clock.skipped(what))
            continue
        make = (lambda: TrainStep(s, name, batch, "bf16", channels_last=True, compile=True)) if compiled else (
            lambda step=step: step)
        rate, warm, note = _warmed_rate(s, make, batch, calls=1 if compiled else 0)   # the compile: forward, backward
        value = None if rate is None else 100 * flops / batch * rate / peak
        best = value if value is not None and (best is None or value > best) else best
        print(f"  {what}: {note or f'{rate:.1f} img/s, {flops / batch * rate / 1e12:.1f} TFLOP/s, MFU {value:.1f}%'}"
              f"{f' (compile {warm:.0f} s)' if compiled else ''}", flush=True)
        rows.append(Row("mfu", what, value, "%", note=note or f"{rate:.1f} img/s",
                        data={"images_per_s": rate, "train_gflops_per_image": flops / batch / 1e9,
                              "peak_tflops": peak / 1e12, "warmup_s": warm}))
        step = None
        free()
    rows.append(Row("mfu", f"{name} MFU, best of the above", best, "%", (">=", MFU_FLOOR),
                    note=f"of a measured bf16 matmul peak of {peak / 1e12:.0f} TFLOP/s"))
    return rows


def _warmed_rate(s: Settings, make: Callable[[], TrainStep], batch: int, calls: int
                 ) -> tuple[float | None, float, str | None]:
    """``make()``'s step called ``calls`` times (its compile), then timed: (img/s, seconds until timed, note).
    A failure (a compile's, say) is a finding, not the end of the pass: no rate, and the note says it."""
    start = time.perf_counter()
    try:
        step = make()
        for _ in range(calls):
            step()
        warm = time.perf_counter() - start
        rate, note = attempt(lambda: images_per_second(s, [step], batch)[0])
    except Exception as exc:
        rate, warm, note = None, time.perf_counter() - start, f"failed: {type(exc).__name__}: {exc}"[:160]
    return rate, warm, note


def launch(s: Settings, clock: Clock) -> list[Row]:
    """yolov8n at 640, batch 64, bf16 (the library's layout) from a batch on the device: a step of
    small kernels, held back by their launches. Eager; the whole step as a CUDA graph
    (``TrainConfig(cuda_graphs=True)``); compiled (``compile=True``); compiled with CUDA graphs of the
    forward and backward (``compile="reduce-overhead"``); compiled with the whole step as a graph:
    img/s and each one's first steps' seconds (compile, recording)."""
    name, batch = "yolov8n", s.batch(64)
    rows, best = [], None
    for mode, graphs in ((None, False), (None, True), ("default", False), ("default", True),
                         ("reduce-overhead", False)):
        what = f"{name} bf16 b{batch} img/s, " + " + ".join(
            (["eager"] if mode is None else [f"compile={mode}"]) + (["cuda_graphs"] if graphs else []))
        if (mode is not None or graphs) and s.smoke:
            rows.append(Row("launch", what, None, "img/s", note="skipped: no compile or CUDA graph in the smoke run"))
            continue
        if rows and clock.over():
            rows.append(clock.skipped(what))
            continue
        # three first calls: reduce-overhead records its graphs on the second, cuda_graphs on the third

        def make(mode=mode, graphs=graphs) -> TrainStep:
            return TrainStep(s, name, batch, "bf16", compile=mode or False, graphs=graphs)

        rate, warm, note = _warmed_rate(s, make, batch, calls=3)
        best = rate if rate is not None and (best is None or rate > best) else best
        print(f"  {what}: {note or f'{rate:.0f} img/s'} (first steps {warm:.0f} s)", flush=True)
        rows.append(Row("launch", what, rate, "img/s", note=note or f"first three steps {warm:.0f} s",
                        data={"images_per_s": rate, "warmup_s": warm, "mode": mode, "cuda_graphs": graphs}))
        free()
    return rows + [Row("launch", f"{name} img/s, best of the above", best, "img/s", (">=", LAUNCH_FLOOR))]


def reference_version() -> str | None:
    """The Ultralytics version importable here, or None."""
    from harness import reference as ref

    return ref.version()


CASES = (("yolov8s", 64, "fp16"), ("yolov8s", 64, "bf16"), ("yolov8n", 64, "fp16"),
         ("yolov8s-seg", 64, "bf16"))   # the seg step: the same masks (one index map an image) on both sides


def reference(s: Settings, clock: Clock) -> list[Row]:
    """The same training step through Ultralytics (its AMP: fp16 with a GradScaler; and bf16),
    on the same batch, layout and device, timed in turns with yolokit's; yolokit's time / theirs."""
    from harness import reference as ref

    version = ref.version()
    if version is None:
        return [Row("reference", "step time yolokit / Ultralytics", None, "x",
                    note="skipped: ultralytics not importable")]
    rows = []
    for name, batch, precision in CASES:
        batch, what = s.batch(batch), f"{name} {precision} step time yolokit / Ultralytics {version}"
        if clock.over():
            rows.append(clock.skipped(what))
            continue

        def measure(name: str = name, batch: int = batch, precision: str = precision) -> list[float]:
            ours = TrainStep(s, name, batch, precision)
            theirs = ref.train_step(name, inputs.random_images(batch, s.imgsz),
                                    inputs.random_targets(batch, BOXES, s.imgsz), s.device,
                                    dtype=getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[precision]),
                                    channels_last=ours.channels_last, masks=ours.masks)
            return images_per_second(s, [ours, theirs], batch)

        rates, note = attempt(measure)
        ratio = rates[1] / rates[0] if rates else None
        note = note or f"yolokit {rates[0]:.1f}, reference {rates[1]:.1f} img/s {ref.NOTES.get(name, '')}".rstrip()
        print(f"  {what}, batch {batch}: {note}{'' if ratio is None else f', ratio {ratio:.2f}'}", flush=True)
        rows.append(Row("reference", what, ratio, "x", ("<=", RATIO), note,
                        {"yolokit_images_per_s": rates and rates[0], "reference_images_per_s": rates and rates[1]}))
    return rows


def reference_elsewhere(python: str, s: Settings, clock: Clock) -> list[Row]:
    """The reference section run by another interpreter (an environment where ultralytics imports), its
    console streamed into this one's as it comes (prefixed ``  | ``). It gets what is left of the section's
    cap less a margin for its own start as its cap (``--cap``), and is stopped at the section's cap."""
    script = Path(__file__).resolve().parents[1] / "gpu.py"
    left = clock.cap_s - clock.elapsed()
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "gpu-results.json"
        cmd = [python, "-u", str(script), "--sections", "reference", "--out", folder,
               "--cap", f"{max(10.0, left - REFERENCE_START_S):.0f}"] + (["--cpu-smoke"] * s.smoke)
        started, lines = time.perf_counter(), []
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as child:
            timer = threading.Timer(max(30.0, left), child.kill)       # the section's cap, whatever the child does
            timer.start()
            try:
                for line in child.stdout:
                    lines.append(line.rstrip("\n"))
                    print(f"  | {lines[-1]}", flush=True)
            finally:
                timer.cancel()
            code = child.wait()
        seconds = time.perf_counter() - started
        if code != 0 or not out.exists():
            why = f"stopped at the section's cap after {seconds:.0f} s" if code < 0 else f"exit {code}"
            return [Row("reference", "step time yolokit / Ultralytics", None, "x",
                        note=f"{why} in {python}: {' / '.join(lines[-3:])[-160:]}")]
        saved = json.loads(out.read_text())["sections"]["reference"]["rows"]
    return [Row(**{k: v for k, v in r.items() if k != "ok"} | {"target": tuple(r["target"]) if r["target"] else None})
            for r in saved]
