"""End to end: the trainer itself on a COCO-sized synthetic set, yolov8s at 640 in bf16.

``yolokit.train.Trainer`` as a user runs it (its own loader, workers, pinning, HSV on the device,
monitor, EMA, validation at the end), once with the augmentation in the workers and once on the
device (``augment_on="device"``, compiled: ``compile_augment``), on 118,287 training images of COCO's size and shape
(``harness.pipeline.coco_sized_yaml``: 640x480 photo-like JPEGs, 1-15 boxes of 80 classes, hard
links to 512 generated ones), batch 64, Mosaic on. A callback times ``SECONDS`` of the epoch
after ``SKIP`` batches (the device synchronised at both ends): images/s, the share of that time
the loop waited for the loader (``data%``, from the trainer's running share) and the GPU's busy
share (NVML). Then the callback runs the trainer's ``time`` budget out, so it stops at its next
step, validates and saves, as a run whose time is up (a whole COCO epoch would take ~2.5
minutes of the lease); the first scan of the 118k labels is timed too, and the epoch's
length at the measured rate is printed.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from harness.pipeline import COCO_TRAIN, coco_sized_yaml
from harness.timing import synchronize

from gpu.common import Clock, Row, Settings
from yolokit.train import Callback

SECONDS, SKIP = 30.0, 20    # timed seconds, batches before the timing starts (cuDNN's search, workers' start,
#                             the device path's compile)
PATHS = ("workers", "device")   # issue 42: the trainer's speed on each augmentation path
ROOT = Path(tempfile.gettempdir()) / "yolokit-coco-sized"


class EpochTiming(Callback):
    """A trainer callback: images, seconds, data wait and GPU busy share over a window of the epoch."""

    def __init__(self, device, skip: int, seconds: float, count: float = float("inf"), trainer=None) -> None:
        from yolokit.accel import DeviceMonitor

        self.device, self.skip, self.seconds, self.count, self.trainer = device, skip, seconds, count, trainer
        self.monitor = DeviceMonitor(device, interval=0.2)
        self.batches = self.images = 0
        self.epoch_start = self.t0 = self.t1 = self.wait0 = self.wait1 = None
        self.last: tuple[float, float] | None = None

    def on_epoch_start(self, epoch: int, epochs: int, batches: int) -> None:
        self.epoch_start = time.perf_counter()

    def on_batch_end(self, losses: dict, images: int, memory_gb: float, data_share: float) -> None:
        self.batches += 1
        if self.t1 is not None:
            return
        if self.batches == self.skip:
            synchronize(self.device)
            self.t0 = time.perf_counter()
            self.wait0 = data_share * (self.t0 - self.epoch_start)
            self.monitor.start()
        elif self.t0 is not None:
            self.images += images
            self.last = (time.perf_counter(), data_share)
            if self.last[0] - self.t0 >= self.seconds or self.batches - self.skip >= self.count:
                synchronize(self.device)
                self.close(time.perf_counter(), data_share)

    def close(self, at: float | None = None, data_share: float | None = None) -> None:
        """The window ends ``at`` (default: the last batch's end, as the host saw it, when the epoch
        ended before the window did)."""
        if self.t0 is None or self.t1 is not None:
            return
        if at is None:
            at, data_share = self.last
        self.t1 = at
        self.wait1 = data_share * (at - self.epoch_start)
        self.monitor.stop()
        if self.trainer is not None:   # the trainer's time budget runs out at its next step: validate, save, end
            self.trainer.deadline = 0.0

    def on_train_end(self) -> None:
        self.monitor.stop()

    def result(self) -> dict:
        elapsed = self.t1 - self.t0
        wait = (self.wait1 - self.wait0) / elapsed
        return {"images_per_s": self.images / elapsed, "seconds": elapsed, "images": self.images,
                "data_share": wait, "samples": len(self.monitor.samples), **self.monitor.summary()}


def coco_epoch(s: Settings, clock: Clock) -> list[Row]:
    from yolokit.data.sources.readers import yolo_index

    images, distinct, val = (COCO_TRAIN, 512, 256) if s.cuda else (32, 8, 4)
    start = time.perf_counter()
    yaml = coco_sized_yaml(ROOT if s.cuda else ROOT.with_name("yolokit-coco-smoke"), images=images,
                           distinct=distinct, val=val)
    made = time.perf_counter() - start
    (yaml.parent / "labels" / "train.yolokit.cache").unlink(missing_ok=True)   # a first scan, whose cache the
    start = time.perf_counter()                                                  # trainer then reads
    yolo_index(yaml, "train")
    scan = time.perf_counter() - start
    print(f"  {images:,} training images ({distinct} distinct) ready in {made:.0f} s; first scan {scan:.1f} s",
          flush=True)
    rows = []
    for augment_on in PATHS:
        if rows and clock.over():
            rows.append(clock.skipped(f"the epoch with augment_on={augment_on}"))
            continue
        rows += _epoch(s, yaml, augment_on, images, scan)
    return rows + [Row("epoch", f"first scan of {images:,} labels", scan, "s")]


def _epoch(s: Settings, yaml: Path, augment_on: str, images: int, scan: float) -> list[Row]:
    """The trainer's epoch with the augmentation on ``augment_on`` (on the device: compiled, with
    ``compile_augment``, except in the smoke run): its rows."""
    from yolokit.train import TrainConfig, Trainer

    seconds, skip, count = (SECONDS, SKIP, float("inf")) if s.cuda else (float("inf"), 2, 6)   # smoke: 6 batches
    batch = s.batch(64)
    compiled = augment_on == "device" and not s.smoke
    with tempfile.TemporaryDirectory() as out:
        # every batch an optimizer step (nbs = batch, as at 64 on the GPU); Mosaic on in this one epoch;
        # the time budget is a safety net (the device path's first batch also compiles): the window's end
        # runs it out
        config = TrainConfig(model="yolov8s", data=str(yaml), imgsz=s.imgsz, batch=batch, nbs=batch, epochs=1,
                             close_mosaic=0, precision="bf16" if s.cuda else "fp32", device=s.device.type,
                             plots=False, out=out, workers=s.workers, augment_on=augment_on, compile_augment=compiled,
                             time=(seconds + (180 if compiled else 90)) / 3600 if s.cuda else 1.0)
        timing = EpochTiming(s.device, skip, seconds, count)
        trainer = Trainer(config, callbacks=[timing])
        timing.trainer = trainer
        trainer.fit()
        timing.close()
        summary = {"workers": trainer.parts.settings.workers, "channels_last": trainer.parts.settings.channels_last,
                   "steps": trainer.progress.steps, "batches": trainer.parts.plan.steps_per_epoch,
                   "augment_on": augment_on, "compile_augment": compiled}
    path = f"augment_on={augment_on}" + (", compiled" if compiled else "")
    what = f"yolov8s COCO-sized epoch, batch {batch}, {path}: img/s (the trainer)"
    if timing.t0 is None:              # the safety net ran out before the window started
        return [Row("epoch", what, None, "img/s", target=(">=", 900.0),
                    note=f"not timed: {summary['steps']} steps within the time budget, fewer than {skip + 1}")]
    got = {**timing.result(), **summary, "scan_s": scan, "train_images": images}
    rate, share, busy = got["images_per_s"], got["data_share"], got.get("mean_utilization_percent")
    epoch_min = images / rate / 60
    said = {"data": "-" if share is None else f"{share:.0%}", "busy": "-" if busy is None else f"{busy:.0f}%"}
    print(f"  yolov8s batch {batch} {config.precision}, {summary['workers']} workers, {path}: {rate:.1f} img/s over "
          f"{got['seconds']:.0f} s, data {said['data']}, GPU busy {said['busy']}; a {images:,}-image epoch takes "
          f"{epoch_min:.1f} min at this rate", flush=True)
    why = "n/a on the CPU" if not s.cuda else "n/a: NVML not readable (pip install nvidia-ml-py)"
    return [Row("epoch", what, rate, "img/s",
                target=(">=", 900.0), note=f"{got['seconds']:.0f} s timed; epoch {epoch_min:.1f} min", data=got),
            Row("epoch", f"waiting for data (data%), {path}", None if share is None else 100 * share, "%",
                note=f"{summary['workers']} loader workers"),
            Row("epoch", f"GPU busy (NVML), {path}", busy, "%", target=(">=", 90.0),
                note=why if busy is None else f"{got['samples']} samples")]
