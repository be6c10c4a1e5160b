"""The training data pipeline as a benchmark: images per second out of a loader.

Decode, Mosaic, random affine, HSV, flip and collate at the YOLOv8 default augmentation,
on the built-in shapes set. Every timed run starts fresh workers and shuts them down at
its end, so no loader keeps working (prefetching) while the other one is timed.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from harness.timing import Timed, cpu_seconds, synchronize
from yolokit.data import DetectionDataset, build_dataloader, make_shapes

IMAGE_KEYS = ("images", "images_uint8", "img")


def dataset_yaml(*, images: int, imgsz: int) -> Path:
    """The shapes set with ``images`` training images of long side ``imgsz`` (generated once, cached)."""
    return make_shapes(n_train=images, n_val=16, imgsz=imgsz, seed=0)


def loader_workers(loader: object) -> list[int]:
    """The process ids of a DataLoader's live workers (its persistent or current iterator's)."""
    iterator = getattr(loader, "_iterator", None) or getattr(loader, "iterator", None)
    return [w.pid for w in getattr(iterator, "_workers", []) if w.pid is not None]


def time_batches(batches: Iterator[dict], count: int, warmup: int, *, key: str | None = None,
                 loader: object | None = None) -> Timed:
    """Seconds, images and CPU seconds (this process and its workers) of ``count`` batches
    drawn after ``warmup`` batches of ``batches``; with ``loader``, only that loader's workers
    count (other loaders' persistent workers prefetch meanwhile)."""
    start, cpu, images = 0.0, 0.0, 0
    children = None
    for done in range(warmup + count):
        if done == warmup:
            children = loader_workers(loader) if loader is not None else None
            start, cpu, images = time.perf_counter(), cpu_seconds(children), 0
        batch = next(batches)
        names = (key,) if key else IMAGE_KEYS
        images += next(batch[k] for k in names if k in batch).shape[0]
    return Timed(time.perf_counter() - start, images, cpu_seconds=cpu_seconds(children) - cpu)


def epochs(loader: Iterable[dict]) -> Iterator[dict]:
    """The batches of ``loader``, epoch after epoch, without end."""
    while True:
        yield from loader


def yolokit_loader(yaml: Path, *, imgsz: int, batch: int, workers: int, uint8: bool = True,
                   hsv_on_device: bool = False):
    """yolokit's training loader as the trainer builds it (``uint8_images`` by default; on CUDA
    the trainer also passes ``hsv_on_device``), and a function timing ``count`` batches after
    ``warmup`` on fresh workers."""
    dataset = DetectionDataset(yaml, "train", imgsz=imgsz, augment=True)
    loader = build_dataloader(dataset, batch, workers=workers, seed=0, uint8_images=uint8,
                              persistent_workers=False, pin_memory=False, hsv_on_device=hsv_on_device)

    def run(count: int, warmup: int) -> Timed:
        batches = iter(loader)
        try:
            return time_batches(batches, count, warmup)
        finally:
            del batches  # a non-persistent iterator shuts its workers down when dropped

    return run, loader


def hsv_step_seconds(batch: int, imgsz: int, device, rounds: int = 5) -> float:
    """Seconds of `to_device`'s HSV step (``apply_hsv_lut_batch``) on a uint8 batch at imgsz on
    ``device``: the median of ``rounds`` after one untimed round."""
    import numpy as np
    import torch

    from yolokit.data.color import apply_hsv_lut_batch
    from yolokit.data.transforms import hsv_lut

    rng = np.random.default_rng(0)
    images = torch.randint(0, 256, (batch, 3, imgsz, imgsz), dtype=torch.uint8, device=device)
    luts = torch.from_numpy(np.stack([hsv_lut(rng) for _ in range(batch)])).to(device)
    times = []
    for _ in range(rounds + 1):
        synchronize(images.device)
        start = time.perf_counter()
        apply_hsv_lut_batch(images, luts)
        synchronize(images.device)
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:]))
