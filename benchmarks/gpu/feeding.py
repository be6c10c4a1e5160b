"""Does the real data loader keep the GPU busy? NVML utilisation while it feeds training; its images/s per core.

Training here is the trainer's loop body on the trainer's loader (shapes set at 640, YOLOv8
default augmentation with Mosaic, uint8 batches in pinned memory, the HSV step on the device
as the trainer does on CUDA, persistent workers, one process per core but one), with the GPU's
utilisation sampled through NVML (``accel.DeviceMonitor``; needs the optional ``nvidia-ml-py``)
over the timed steps.
"""

from __future__ import annotations

import time

from harness.pipeline import epochs, hsv_step_seconds, yolokit_loader
from harness.timing import synchronize

from gpu.common import Clock, Row, Settings, TrainStep, attempt, images_per_second, shapes_yaml

BUSY = 90.0  # issue 16: the loader keeps the GPU >= 90% busy training yolov8s at 640


def utilisation(s: Settings, clock: Clock) -> list[Row]:
    """yolov8s and yolov8n training from the real loader (bf16, batch 64, ~20 s each on the GPU);
    then the loader alone (images/s, and per CPU-second of its processes) against the images/s
    yolov8n training eats from batches already on the GPU."""
    from yolokit.data import DetectionDataset, build_dataloader

    yaml = shapes_yaml(s)
    dataset = DetectionDataset(yaml, "train", imgsz=s.imgsz, augment=True)
    batch, rows, fed = s.batch(64), [], {}
    for name in ("yolov8s", "yolov8n"):
        if clock.over():
            rows.append(clock.skipped(f"{name} GPU utilisation with the real loader"))
            continue
        loader = build_dataloader(dataset, batch, workers=s.workers, shuffle=True, seed=0, uint8_images=True,
                                  hsv_on_device=s.cuda)
        result, note = attempt(
            lambda loader=loader, name=name: train_from_loader(s, TrainStep(s, name, 1, "bf16"), loader))
        del loader
        if result is None:
            rows.append(Row("loader", f"{name} GPU utilisation with the real loader", None, note=note))
            continue
        fed[name] = result["images_per_s"]
        util = result.get("mean_utilization_percent")
        why = "n/a on the CPU" if not s.cuda else "n/a: NVML not readable (pip install nvidia-ml-py)"
        print(f"  {name} batch {batch}, {s.workers} workers: {result['images_per_s']:.1f} img/s, waiting for data "
              f"{result['data_wait_share']:.0%} of the time, GPU busy {why if util is None else f'{util:.0f}%'}",
              flush=True)
        rows += [Row("loader", f"{name} GPU utilisation with the real loader (NVML)", util, "%",
                     (">=", BUSY) if name == "yolov8s" else None,
                     why if util is None else f"{result['samples']} samples", result),
                 Row("loader", f"{name} img/s with the real loader", result["images_per_s"], "img/s",
                     note=f"waiting for data {result['data_wait_share']:.0%} of the time")]
    return rows + starvation(s, clock, yaml, batch, fed.get("yolov8n"))


def train_from_loader(s: Settings, parts: TrainStep, loader) -> dict:
    """The trainer's loop body over ``loader`` (no accumulation): ``warmup`` steps, then steps
    timed for ``TIMED_S`` seconds (2 steps in the smoke run) with the device sampled.

    Returns:
        images_per_s, data_wait_share (time blocked on the loader), steps, samples and the
        monitor's summary (``mean_utilization_percent`` where NVML reads it).
    """
    from yolokit.accel import DeviceMonitor
    from yolokit.data import to_device

    warmup, seconds, most = (10, 20.0, 10_000) if s.cuda else (1, float("inf"), 2)
    monitor = DeviceMonitor(s.device, interval=0.2)
    batches = epochs(loader)
    steps, wait, images, start = 0, 0.0, 0, 0.0
    try:
        while True:
            if steps == warmup:
                synchronize(s.device)
                monitor.start()
                start, wait, images = time.perf_counter(), 0.0, 0
            elif steps > warmup and (steps - warmup >= most or time.perf_counter() - start >= seconds):
                break
            t0 = time.perf_counter()
            batch = next(batches)
            wait += time.perf_counter() - t0
            data = to_device(batch, s.device, non_blocking=True)
            parts.forward_backward(data["images"], data["targets"], batch["max_boxes"], len(data["images"]))
            parts.amp.step(parts.optimizer, clip_grad_norm=10.0, blocking=False)
            parts.optimizer.zero_grad(set_to_none=True)
            images += len(data["images"])
            steps += 1
        synchronize(s.device)
        elapsed = time.perf_counter() - start
    finally:
        monitor.stop()
        batches.close()  # the loader's iterator, and its workers, go with it
    return {"images_per_s": images / elapsed, "data_wait_share": wait / elapsed, "steps": steps - warmup,
            "samples": len(monitor.samples), **monitor.summary()}


def starvation(s: Settings, clock: Clock, yaml, batch: int, fed: float | None) -> list[Row]:
    """The loader alone (fresh workers, one epoch's batches) against what yolov8n training eats."""
    what = "yolov8n: cores the loader needs to keep up"
    if clock.over():
        return [clock.skipped(what)]
    run, _ = yolokit_loader(yaml, imgsz=s.imgsz, batch=batch, workers=s.workers, hsv_on_device=s.cuda)
    timed = run(24, 6) if s.cuda else run(14, 1)  # an epoch: 32 batches of 64 (GPU), 16 of 2 (smoke)
    rate = timed.units / timed.seconds
    per_core = timed.units / timed.cpu_seconds if timed.cpu_seconds else float("nan")
    eats, note = attempt(lambda: images_per_second(s, [TrainStep(s, "yolov8n", batch, "bf16")], batch)[0])
    needed = eats / per_core if eats else None
    print(f"  loader alone, {s.workers} workers: {rate:.1f} img/s, {per_core:.1f} img/s per CPU-second; yolov8n "
          f"training eats {note or f'{eats:.1f}'} img/s from batches on the device"
          f"{'' if needed is None else f': {needed:.1f} cores to keep up'}", flush=True)
    verdict = None if needed is None else ("starves it" if needed > s.workers else "keeps up")
    hsv_ms = hsv_step_seconds(batch, s.imgsz, s.device) * 1000
    print(f"  the HSV step on the device (to_device), batch {batch}: {hsv_ms:.2f} ms", flush=True)
    return [Row("loader", f"HSV step on the device, ms per batch of {batch}", hsv_ms, "ms",
                note="to_device applies it; the workers only draw the gains"),
            Row("loader", f"loader alone, {s.workers} workers, img/s", rate, "img/s",
                note=f"{fed:.1f} img/s reached yolov8n training" if fed else ""),
            Row("loader", "loader img/s per core (per CPU-second)", per_core, "img/s"),
            Row("loader", "yolov8n training eats (batches on the device)", eats, "img/s", note=note),
            Row("loader", what, needed,
                note=f"{s.workers} worker processes here: the loader {verdict}" if verdict else note,
                data={"loader_images_per_s": rate, "per_core": per_core, "gpu_images_per_s": eats})]

