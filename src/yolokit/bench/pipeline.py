"""The training data pipeline as a benchmark: images per second out of a loader.

Decode, Mosaic, random affine, HSV, flip and collate at the YOLOv8 default augmentation,
on the built-in shapes set. Every timed run starts fresh workers and shuts them down at
its end, so no loader keeps working (prefetching) while the other one is timed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

from yolokit.bench.timing import Timed
from yolokit.data import DetectionDataset, build_dataloader, make_shapes

IMAGE_KEYS = ("images", "images_uint8", "img")


def dataset_yaml(*, images: int, imgsz: int) -> Path:
    """The shapes set with ``images`` training images of long side ``imgsz`` (generated once, cached)."""
    return make_shapes(n_train=images, n_val=16, imgsz=imgsz, seed=0)


def time_batches(batches: Iterator[dict], count: int, warmup: int, *, key: str | None = None) -> Timed:
    """Seconds and images of ``count`` batches drawn after ``warmup`` batches of ``batches``."""
    start, images = 0.0, 0
    for done in range(warmup + count):
        if done == warmup:
            start, images = time.perf_counter(), 0
        batch = next(batches)
        names = (key,) if key else IMAGE_KEYS
        images += next(batch[k] for k in names if k in batch).shape[0]
    return Timed(time.perf_counter() - start, images)


def cpu_seconds() -> float:
    """User + system CPU time of this process and its live children (the loader workers), Linux only."""
    tick = os.sysconf("SC_CLK_TCK")
    pids = ["self"]
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids += f.read().split()
        except OSError:
            pass
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


def yolokit_loader(yaml: Path, *, imgsz: int, batch: int, workers: int, uint8: bool = True):
    """yolokit's training loader as the trainer builds it (``uint8_images`` by default), and
    a function timing ``count`` batches after ``warmup`` on fresh workers."""
    dataset = DetectionDataset(yaml, "train", imgsz=imgsz, augment=True)
    loader = build_dataloader(dataset, batch, workers=workers, seed=0, uint8_images=uint8,
                              persistent_workers=False, pin_memory=False)

    def run(count: int, warmup: int) -> Timed:
        batches = iter(loader)
        try:
            return time_batches(batches, count, warmup)
        finally:
            del batches  # a non-persistent iterator shuts its workers down when dropped

    return run, loader
