"""Memory: activation checkpointing, the batch finder against the true largest batch, an OOM survived mid-run.

On the CPU (``--cpu-smoke``) nothing runs out of memory, so the batch finder and the
OOM run meet an injected limit instead: a probe or micro-batch above ``SMOKE_LIMIT``
images raises ``torch.OutOfMemoryError``, and the finder reads a linear memory model
that fits exactly ``SMOKE_LIMIT`` images. Every other line is the GPU's code path.
"""

from __future__ import annotations

import math
import traceback
import warnings
from collections.abc import Callable

import torch
from harness import inputs
from harness.timing import peak_memory

from gpu.common import BOXES, Clock, Row, Settings, TrainStep, attempt, free, images_per_second, shapes_yaml

CUT, SLOWER = 40.0, 1.3        # checkpointing: peak memory -40% or more, for <= 1.3x the step time
FOUND, TRIALS = 0.9, 8         # the finder: >= 90% of the true largest batch in <= 8 trials
SMOKE_BYTES, SMOKE_FIXED = 1e9, 1e8  # the smoke run's device memory and what the model holds
SMOKE_LIMIT = 12               # images that "fit" in the CPU smoke run (above the finder's largest probe, 8)


def checkpointing(s: Settings, clock: Clock) -> list[Row]:
    """Peak memory (allocator peak over two steps, model and optimizer state included) and
    images/s of yolov8l and yolov3 at batch 32 in bf16, without and with checkpointing."""
    rows = []
    for name in ("yolov8l", "yolov3"):
        batch, result = s.batch(32), {}
        for ckpt in (False, True):
            if clock.over():
                result[ckpt] = None
                continue

            def measure(name: str = name, batch: int = batch, ckpt: bool = ckpt) -> tuple[float, int | None]:
                step = TrainStep(s, name, batch, "bf16", checkpoint=ckpt)
                rate = images_per_second(s, [step], batch)[0]
                return rate, peak_memory(lambda: [step() for _ in range(1 if s.smoke else 2)], s.device, extra=False)

            result[ckpt], note = attempt(measure)
            print(f"  {name} batch {batch} checkpointing {'on ' if ckpt else 'off'}: "
                  f"{note or f'{result[ckpt][0]:.1f} img/s, peak {(result[ckpt][1] or 0) / 2**30:.2f} GiB'}",
                  flush=True)
        if result.get(False) and result.get(True) and result[False][1] and result[True][1]:
            (r0, m0), (r1, m1) = result[False], result[True]
            data = {"images_per_s": r0, "images_per_s_checkpointed": r1, "peak_gib": m0 / 2**30,
                    "peak_gib_checkpointed": m1 / 2**30}
            rows += [Row("checkpointing", f"{name} batch {batch} peak memory cut", 100 * (1 - m1 / m0), "%",
                         (">=", CUT), f"{m0 / 2**30:.2f} -> {m1 / 2**30:.2f} GiB", data),
                     Row("checkpointing", f"{name} batch {batch} step time on / off", r0 / r1, "x", ("<=", SLOWER),
                         f"{r0:.1f} -> {r1:.1f} img/s", data)]
        else:
            note = "out of memory or skipped (cap)"
            rows += [Row("checkpointing", f"{name} batch {batch} peak memory cut", None, note=note),
                     Row("checkpointing", f"{name} batch {batch} step time on / off", None, note=note)]
    return rows


def batch_finder(s: Settings, clock: Clock) -> list[Row]:
    """The trainer's ``batch="auto"`` (``train.autobatch.measure_batch`` with its worst-case
    ``training_probe``, yolov8s, bf16) at its own fraction (0.95, the target's row) and at 0.9,
    against the true largest batch (bisection of the same probe without margin, between the first
    size found and a bound above it); then an OOM survived mid-run."""
    from yolokit.data import DetectionDataset
    from yolokit.train import TrainConfig
    from yolokit.train.autobatch import AUTO_FRACTION, measure_batch, training_probe, worst_case_boxes

    name, rows = "yolov8s", []
    dataset = DetectionDataset(shapes_yaml(s), "train", imgsz=s.imgsz)
    boxes = worst_case_boxes(dataset, TrainConfig())
    parts = TrainStep(s, name, 1, "bf16")
    probe = training_probe(parts.model, parts.net, parts.criterion, parts.amp, s.device, imgsz=s.imgsz,
                           max_boxes=boxes, state_tensors=1, channels_last=parts.channels_last)
    limit = None if s.cuda else SMOKE_LIMIT
    max_size = 1024 if s.cuda else 32
    largest = None
    for fraction in (AUTO_FRACTION, 0.9):
        what = f"{name} finder at fraction {fraction:g} / true largest batch"
        if clock.over():
            rows += [clock.skipped(what)]
            continue
        trials: list[int] = []
        counted = _counted(probe, trials, limit)
        memory = None if s.cuda else (SMOKE_BYTES, _smoke_peak(counted))
        picked = measure_batch(counted, s.device, fraction=fraction, max_size=max_size, memory=memory)
        if largest is None:
            largest = _true_largest(probe, limit, picked, max_size)
        ratio = picked / largest
        sizes = len(set(trials))   # a trial is a size tried; each probe size runs twice (the second is measured)
        print(f"  {name} ({boxes} boxes per image): fraction {fraction:g} picks {picked} in {sizes} trials "
              f"({len(trials)} steps); true largest {largest}: {ratio:.0%}", flush=True)
        note = f"picked {picked} of {largest} ({boxes} boxes/image)"
        data = {"picked": picked, "true_largest": largest, "trials": trials, "boxes_per_image": boxes}
        rows += [Row("batch", what, ratio, target=(">=", FOUND) if fraction == AUTO_FRACTION else None,
                     note=note if fraction == AUTO_FRACTION else f"{note}; not the default", data=data),
                 Row("batch", f"{name} finder at fraction {fraction:g}: trials (sizes tried)", float(sizes),
                     target=("<=", TRIALS), note="steps: " + " ".join(map(str, trials)))]
    del parts, probe
    free()
    if clock.over() or largest is None:
        return rows + [clock.skipped("OOM mid-run: recoveries")]
    try:
        return rows + oom_mid_run(s, name, max(2, math.floor(0.8 * largest)) if s.cuda else 4)
    except Exception as exc:  # keep the finder's rows
        traceback.print_exc()
        return rows + [Row("batch", "OOM mid-run: recoveries at step 3", None, note=f"error: {exc}"[:200])]


def _counted(probe: Callable[[int], None], trials: list[int], limit: int | None) -> Callable[[int], None]:
    """``probe`` that records each size it is called with, and (CPU) fails above ``limit`` like a full device."""

    def counted(b: int) -> None:
        trials.append(b)
        if limit is not None and b > limit:
            raise torch.OutOfMemoryError(f"injected: {b} images > the smoke run's limit of {limit}")
        probe(b)

    return counted


def _smoke_peak(counted: Callable[[int], None]) -> Callable[[int], float]:
    """Peak bytes of the smoke run's memory model: the probe runs (a trial), ``SMOKE_LIMIT`` images fill it."""

    def peak(b: int) -> float:
        counted(b)
        return SMOKE_FIXED + (SMOKE_BYTES - SMOKE_FIXED) * b / SMOKE_LIMIT

    return peak


def _true_largest(probe: Callable[[int], None], limit: int | None, start: int, max_size: int) -> int:
    """The largest batch the probe runs without running out of memory (no margin), ``start`` fitting:
    bisection between it and a bound above it (``start / 0.85``, doubled while it fits), not from
    twice ``start``: each size tried at ~400 images costs a step and cuDNN's search."""
    from yolokit.accel.batch_size import _fits, bisect_fitting

    step = _counted(probe, [], limit)
    good, bad = start, min(max_size + 1, math.ceil(start / 0.85))
    while bad <= max_size and _fits(step, bad):
        good, bad = bad, min(max_size + 1, 2 * bad)
    return bisect_fitting(step, good, bad)


def oom_mid_run(s: Settings, name: str, batch: int) -> list[Row]:
    """Four steps of ``batch`` images (yolov8s, bf16) through the trainer's ``run_batch`` and an
    ``accel.Accumulator``; before the third, memory is taken away (CUDA: a ballast tensor leaving
    55% of the activation peak of step 1 free; CPU: micro-batches above half the batch fail), so
    step 3 really runs out mid-run. It must be split and replayed with the same images per
    optimizer step, and step 4 must run at the new split."""
    from yolokit.accel import Accumulator, retry_step
    from yolokit.data import to_device
    from yolokit.train.step import run_batch

    parts = TrainStep(s, name, 1, "bf16")
    acc = Accumulator(parts.net, accumulate=1)
    gen = torch.Generator().manual_seed(0)
    host = {"images_uint8": torch.randint(0, 256, (batch, 3, s.imgsz, s.imgsz), dtype=torch.uint8, generator=gen),
            "targets": inputs.random_targets(batch, BOXES, s.imgsz), "max_boxes": BOXES}
    limit: list[int | None] = [None]

    def forward_backward(micro: dict) -> tuple[int, torch.Tensor]:
        if limit[0] is not None and len(micro["images_uint8"]) > limit[0]:
            raise torch.OutOfMemoryError("injected: the smoke run's memory is taken away")
        data = to_device(micro, s.device, non_blocking=True)
        n = len(data["images"])
        return n, parts.forward_backward(data["images"], data["targets"], micro["max_boxes"], n)

    def step() -> tuple[int, float]:
        outs = run_batch(acc, host, forward_backward)
        assert acc.step_due()
        acc.sync()
        retry_step(acc, parts.amp.step, parts.optimizer, clip_grad_norm=10.0, blocking=False)
        parts.optimizer.zero_grad(set_to_none=True)
        return sum(n for n, _ in outs), float(sum(loss for _, loss in outs))

    activations = peak_memory(step, s.device)  # step 1: what one step adds at its peak
    step()
    ballast = None
    if s.cuda:
        free()
        room = torch.cuda.mem_get_info(s.device)[0] - int(0.55 * activations)
        ballast = torch.empty(max(0, room), dtype=torch.uint8, device=s.device)
    else:
        limit[0] = batch // 2
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            images3, loss3 = step()
            recovered, splits = acc.recoveries, acc.splits
            images4, loss4 = step()
    finally:
        del ballast
        free()
    said = "; ".join(str(w.message) for w in caught if issubclass(w.category, RuntimeWarning))
    print(f"  OOM mid-run, batch {batch}: step 3 {images3} images in {splits} micro-batches after {recovered} "
          f"recoveries (loss {loss3:.3g}), step 4 {images4} images, {acc.recoveries} recoveries in all. {said}",
          flush=True)
    finite = math.isfinite(loss3) and math.isfinite(loss4)
    data = {"batch": batch, "activation_peak_gib": (activations or 0) / 2**30, "splits": splits,
            "recoveries_step3": recovered, "recoveries_total": acc.recoveries, "images_step3": images3,
            "images_step4": images4, "effective_batch": batch, "losses": [loss3, loss4],
            "warnings": said}
    return [Row("batch", "OOM mid-run: recoveries at step 3", float(recovered), target=(">=", 1),
                note=f"{splits} micro-batches per loader batch after it", data=data),
            Row("batch", f"OOM mid-run: images in step 3 (effective batch {batch})", float(images3),
                target=("==", batch), note="losses finite" if finite else "loss NOT finite"),
            Row("batch", "OOM mid-run: new recoveries at step 4", float(acc.recoveries - recovered),
                target=("<=", 0), note=f"{images4} images")]
