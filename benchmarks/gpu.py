"""Training speed on a CUDA GPU: throughput, precision, memory, batch finder, utilisation, MFU.

    python benchmarks/gpu.py                                   # every section, default models
    python benchmarks/gpu.py --sections throughput mfu --models yolov8n yolov8s --quick
    /path/to/bench-venv/bin/python benchmarks/gpu.py --sections reference

Sections (all at 640 px, SGD, clip at norm 10, as the trainer steps; synthetic batches on
the device unless said otherwise):

- throughput: training images/s for each model in fp32, bf16 and fp16, with and without
  channels_last, and with torch.compile (for bf16 + channels_last unless --compile-all);
  the speed-up of mixed precision over fp32 is printed with it.
- checkpointing: peak memory and images/s with and without activation checkpointing of
  every backbone stage and neck block (bf16).
- batch: the batch ``yolokit.accel.find_batch_size`` picks (the trainer's binsearch, 10%
  margin) and ``predict_batch_size``'s, against the true largest batch that fits
  (bisection without margin, bf16).
- utilisation: GPU utilisation through NVML (``DeviceMonitor``; needs nvidia-ml-py) while
  the real data loader (shapes set at 640, uint8 batches, pinned) feeds yolov8n training,
  with the share of time spent waiting for data.
- mfu: model FLOPs utilisation: training FLOPs of one step (torch.utils.flop_counter,
  forward + backward) times steps per second, over a measured bf16 matmul peak.
- reference: the same step through Ultralytics (fp16 AMP with its GradScaler, as its
  trainer runs; and bf16), with the ratio yolokit / reference. Needs ultralytics.

Without CUDA the script says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import torch

from harness import inputs
from harness.pipeline import dataset_yaml
from harness.timing import alternate, header, median, peak_memory, synchronize

MODELS = ("yolov8n", "yolov8s", "yolov8m", "yolov3")
DEVICE = torch.device("cuda")  # --cpu-smoke runs the code paths on the CPU, with tiny sizes
BATCH = {"yolov8n": 64, "yolov8s": 64, "yolov8m": 32, "yolov3": 32, "yolov3-tiny": 64}
SECTIONS = ("throughput", "checkpointing", "batch", "utilisation", "mfu", "reference")
IMGSZ = 640


def make_step(name: str, batch: int, precision: str, *, channels_last: bool = False, compile: bool = False,
              checkpoint: bool = False) -> Callable[[], None]:
    """yolokit's training step (the trainer's order of operations) on a synthetic batch on the GPU."""
    import yolokit
    from yolokit.accel import Precision, enable_activation_checkpointing, perf
    from yolokit.train import TrainConfig
    from yolokit.train.optim import build_optimizer
    from yolokit.train.trainer import build_loss

    device = DEVICE
    model = yolokit.create_model(name).to(device).train()
    if checkpoint:
        enable_activation_checkpointing(model.checkpoint_units("all"))
    perf.prepare_model(model, channels_last=channels_last or None)
    net = perf.prepare_model(model, compile=compile)
    criterion = build_loss(model, TrainConfig())
    optimizer = build_optimizer(model, "sgd", 0.01, 0.937, 5e-4)
    amp = Precision(precision, device)
    images = inputs.random_images(batch, IMGSZ).to(device)
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    targets = inputs.random_targets(batch, 8, IMGSZ).to(device)

    def step() -> None:
        with amp.autocast():
            loss, _ = criterion(net(images), targets)
        amp.backward(loss * batch)
        amp.step(optimizer, clip_grad_norm=10.0)
        optimizer.zero_grad(set_to_none=True)

    return step


def images_per_second(step: Callable[[], None], batch: int, *, warmup: int, iters: int) -> float:
    """Training images per second over ``iters`` steps after ``warmup`` (the device synchronized around them)."""
    seconds = alternate([step], warmup=warmup, repeats=1, inner=iters, device=DEVICE)[0][0]
    return batch / seconds


def peak_bytes(step: Callable[[], None], steps: int = 3) -> int | None:
    """Peak memory of ``steps`` steps, what was allocated before included (model, optimizer state)."""
    return peak_memory(lambda: [step() for _ in range(steps)], DEVICE, extra=False)


def _free() -> None:
    import gc

    gc.collect()
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()


def _guard(fn: Callable[[], object]) -> object:
    """The result, or "OOM" when the GPU runs out of memory."""
    try:
        return fn()
    except torch.OutOfMemoryError:
        return "OOM"
    finally:
        _free()


def throughput(args, out: dict) -> None:
    print("\n== throughput: training images/s at 640 (synthetic batches on the GPU) ==")
    print(f"  {'model':<10}{'batch':>6}  {'precision':<6}{'channels_last':>14}{'compile':>9}{'img/s':>10}{'vs fp32':>9}")
    rows = []
    for name in args.models:
        batch = args.batch or BATCH[name]
        fp32 = {}
        for precision in ("fp32", "bf16", "fp16"):
            for cl in (False, True):
                for comp in (False, True):
                    if comp and (DEVICE.type != "cuda" or not (args.compile_all or (precision == "bf16" and cl))):
                        continue
                    step = _guard(lambda: make_step(name, batch, precision, channels_last=cl, compile=comp))
                    rate = step if step == "OOM" else _guard(
                        lambda step=step: images_per_second(step, batch, warmup=args.warmup + 3 * comp, iters=args.iters))
                    del step
                    if precision == "fp32":
                        fp32[(cl, comp)] = rate
                    base = fp32.get((cl, False))
                    speedup = rate / base if isinstance(rate, float) and isinstance(base, float) else None
                    rows.append({"model": name, "batch": batch, "precision": precision, "channels_last": cl,
                                 "compile": comp, "images_per_s": rate, "speedup_vs_fp32": speedup})
                    shown = rate if rate == "OOM" else f"{rate:.1f}"
                    print(f"  {name:<10}{batch:>6}  {precision:<6}{str(cl):>14}{str(comp):>9}{shown:>10}"
                          f"{'' if speedup is None else f'{speedup:.2f}x':>9}", flush=True)
    out["throughput"] = rows


def checkpointing(args, out: dict) -> None:
    print("\n== activation checkpointing (bf16): peak memory and its time cost ==")
    rows = []
    for name in args.models:
        batch = args.batch or BATCH[name]
        result = {}
        for ckpt in (False, True):
            step = make_step(name, batch, "bf16", checkpoint=ckpt)
            rate = _guard(lambda step=step: images_per_second(step, batch, warmup=args.warmup, iters=args.iters))
            peak = _guard(lambda step=step: peak_bytes(step))
            del step
            _free()
            result[ckpt] = (rate, peak)
        (r0, m0), (r1, m1) = result[False], result[True]
        row = {"model": name, "batch": batch, "images_per_s": r0, "images_per_s_checkpointed": r1,
               "peak_gib": m0 / 2**30 if isinstance(m0, int) else m0,
               "peak_gib_checkpointed": m1 / 2**30 if isinstance(m1, int) else m1}
        rows.append(row)
        if all(isinstance(v, (int, float)) for v in (r0, r1, m0, m1)):
            print(f"  {name:<10} batch {batch:>4}: peak {m0 / 2**30:6.2f} -> {m1 / 2**30:6.2f} GiB "
                  f"({m1 / m0:.0%}), {r0:7.1f} -> {r1:7.1f} img/s (time x{r0 / r1:.2f})", flush=True)
        else:
            print(f"  {name:<10} batch {batch:>4}: {row}", flush=True)
    out["checkpointing"] = rows


def batch_finder(args, out: dict) -> None:
    from yolokit.accel import find_batch_size, predict_batch_size

    print("\n== batch finder (bf16, 640): picked vs the true largest batch that fits ==")
    rows = []
    for name in args.models:
        def step_at(b: int) -> None:
            step = make_step(name, b, "bf16")
            step()
            step()  # the second step holds the optimizer state too
            synchronize(DEVICE)

        start = time.perf_counter()
        picked = find_batch_size(step_at, start=1, max_size=args.max_batch, mode="binsearch")  # as the trainer
        t_pick = time.perf_counter() - start
        predicted = _guard(lambda: predict_batch_size(step_at, max_size=args.max_batch)) \
            if DEVICE.type == "cuda" else None  # it reads the device's total memory
        largest = find_batch_size(step_at, start=max(1, picked), max_size=args.max_batch, mode="binsearch", margin=0.0)
        over = _guard(lambda: step_at(largest + 1)) if largest < args.max_batch else None
        rows.append({"model": name, "find_batch_size": picked, "seconds": t_pick, "predict_batch_size": predicted,
                     "true_largest": largest, "largest_plus_one": "OOM" if over == "OOM" else "fits"})
        print(f"  {name:<10} find_batch_size {picked:>5} ({t_pick:.0f} s)   predict_batch_size {predicted!s:>5}   "
              f"true largest {largest:>5} (+1: {'OOM' if over == 'OOM' else 'fits (capped)'})", flush=True)
    out["batch"] = rows


def utilisation(args, out: dict) -> None:
    from yolokit.accel import DeviceMonitor
    from yolokit.data import DetectionDataset, build_dataloader, to_device

    print("\n== GPU utilisation while the real data loader feeds training (yolov8n, bf16) ==")
    name, batch = "yolov8n", args.batch or BATCH["yolov8n"]
    workers = min(16, os.cpu_count() or 1)
    yaml = dataset_yaml(images=1024 if DEVICE.type == "cuda" else 16, imgsz=IMGSZ)
    loader = build_dataloader(DetectionDataset(yaml, "train", imgsz=IMGSZ, augment=True), batch, workers=workers,
                              seed=0, uint8_images=True, pin_memory=DEVICE.type == "cuda", drop_last=True)
    import yolokit
    from yolokit.accel import Precision
    from yolokit.train import TrainConfig
    from yolokit.train.optim import build_optimizer
    from yolokit.train.trainer import build_loss

    model = yolokit.create_model(name).to(DEVICE).train()
    criterion, amp = build_loss(model, TrainConfig()), Precision("bf16", DEVICE)
    optimizer = build_optimizer(model, "sgd", 0.01, 0.937, 5e-4)
    steps, wait, images = 0, 0.0, 0
    monitor = DeviceMonitor(DEVICE, interval=0.1)
    start = None
    for epoch in range(100):
        batches = iter(loader)
        while True:
            t0 = time.perf_counter()
            data = next(batches, None)
            if data is None:
                break
            data = to_device(data, DEVICE, non_blocking=True)
            if steps == args.warmup:
                synchronize(DEVICE)
                monitor.start()
                start, wait, images = time.perf_counter(), 0.0, 0
            elif steps > args.warmup:
                wait += time.perf_counter() - t0
            with amp.autocast():
                loss, _ = criterion(model(data["images"]), data["targets"])
            amp.backward(loss * batch)
            amp.step(optimizer, clip_grad_norm=10.0)
            optimizer.zero_grad(set_to_none=True)
            images += batch
            steps += 1
            if steps >= args.warmup + 4 * args.iters:
                break
        if steps >= args.warmup + 4 * args.iters:
            break
    synchronize(DEVICE)
    elapsed = time.perf_counter() - start
    monitor.stop()
    summary = monitor.summary()
    row = {"model": name, "batch": batch, "workers": workers, "images_per_s": images / elapsed,
           "data_wait_share": wait / elapsed, **summary}
    out["utilisation"] = row
    util = summary.get("mean_utilization_percent")
    print(f"  {workers} workers, batch {batch}: {images / elapsed:.1f} img/s, waiting for data {wait / elapsed:.0%} "
          f"of the time, GPU utilisation {'n/a (no NVML: pip install nvidia-ml-py)' if util is None else f'{util:.0f}%'}"
          f" over {len(monitor.samples)} samples")


def matmul_peak(dtype: torch.dtype = torch.bfloat16, n: int = 8192, iters: int = 50) -> float:
    """Measured dense matmul FLOP/s of the GPU in ``dtype``."""
    a, b = torch.randn(n, n, device=DEVICE, dtype=dtype), torch.randn(n, n, device=DEVICE, dtype=dtype)
    seconds = alternate([lambda: a @ b], warmup=5, repeats=1, inner=iters, device=DEVICE)[0][0]
    return 2 * n**3 / seconds


def mfu(args, out: dict) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    peak = matmul_peak(n=8192 if DEVICE.type == "cuda" else 256, iters=50 if DEVICE.type == "cuda" else 2)
    print(f"\n== model FLOPs utilisation (bf16 + channels_last; measured bf16 matmul peak {peak / 1e12:.0f} TFLOP/s) ==")
    rows = []
    for name in args.models:
        batch = args.batch or BATCH[name]
        step = make_step(name, batch, "bf16", channels_last=True)
        step()
        with FlopCounterMode(display=False) as counter:
            step()
        flops = counter.get_total_flops()
        rate = images_per_second(step, batch, warmup=args.warmup, iters=args.iters)
        achieved = flops / batch * rate
        rows.append({"model": name, "batch": batch, "train_gflops_per_image": flops / batch / 1e9,
                     "images_per_s": rate, "achieved_tflops": achieved / 1e12, "peak_tflops": peak / 1e12,
                     "mfu": achieved / peak})
        print(f"  {name:<10} batch {batch:>4}: {flops / batch / 1e9:7.1f} GFLOP per image (train), {rate:8.1f} img/s,"
              f" {achieved / 1e12:6.1f} TFLOP/s, MFU {achieved / peak:.1%}", flush=True)
        del step
        _free()
    out["mfu"] = rows


def reference(args, out: dict) -> None:
    from harness import reference as ref

    version = ref.version()
    if version is None:
        print("\n== reference: skipped (ultralytics is not importable here) ==")
        return
    print(f"\n== the same training step through Ultralytics {version}: ratio = yolokit / reference time ==")
    rows = []
    for name in args.models:
        if name not in ref.YAMLS:
            continue
        batch = args.batch or BATCH[name]
        images, targets = inputs.random_images(batch, IMGSZ), inputs.random_targets(batch, 8, IMGSZ)
        for precision, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
            ours = make_step(name, batch, precision)
            theirs = ref.train_step(name, images, targets, DEVICE, dtype=dtype)
            runs = alternate([ours, theirs], warmup=args.warmup + 1, repeats=5, inner=args.iters, device=DEVICE)
            mo, mt = (batch / median(r) for r in runs)  # images/s, medians of 5 runs A B A B
            rows.append({"model": name, "precision": precision, "batch": batch, "yolokit_images_per_s": mo,
                         "reference_images_per_s": mt, "ratio": mt / mo, "note": ref.NOTES.get(name, "")})
            print(f"  {name:<10} {precision}  batch {batch:>4}: yolokit {mo:8.1f} img/s, reference {mt:8.1f} img/s, "
                  f"ratio {mt / mo:.2f}  {ref.NOTES.get(name, '')}", flush=True)
            del ours, theirs
            _free()
    out["reference"] = rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(BATCH))
    parser.add_argument("--batch", type=int, default=None, help="batch for every model (default: per model)")
    parser.add_argument("--iters", type=int, default=30, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--max-batch", type=int, default=1024, help="largest batch the finder tries")
    parser.add_argument("--compile-all", action="store_true", help="torch.compile every throughput configuration")
    parser.add_argument("--quick", action="store_true", help="iters 5, warmup 3: a smoke run")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="run every code path on the CPU at 64 px, batch 2 (checks the script; numbers meaningless)")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        global DEVICE, IMGSZ
        DEVICE, IMGSZ = torch.device("cpu"), 64
        args.batch, args.iters, args.warmup, args.max_batch = args.batch or 2, 1, 1, 4
    elif not torch.cuda.is_available():
        print(f"benchmarks/gpu.py needs a CUDA GPU, and torch.cuda.is_available() is False here "
              f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}). "
              f"For the CPU comparison run benchmarks/run.py.", file=sys.stderr)
        return 2
    if args.quick:
        args.iters, args.warmup = 5, 3
    torch.backends.cudnn.benchmark = True  # as the trainer's perf.configure sets it
    described = header()
    print(described)
    out: dict = dict(line.split(": ", 1) for line in described.splitlines())  # command, machine, versions
    for name in args.sections:
        {"throughput": throughput, "checkpointing": checkpointing, "batch": batch_finder,
         "utilisation": utilisation, "mfu": mfu, "reference": reference}[name](args, out)
        _free()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
