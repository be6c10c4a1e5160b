"""The training data pipeline as a benchmark: images per second out of a loader.

Decode, Mosaic, random affine, HSV, flip and collate at the YOLOv8 default augmentation,
on the built-in shapes set. Every timed run starts fresh workers and shuts them down at
its end, so no loader keeps working (prefetching) while the other one is timed.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from harness.timing import Timed, cpu_seconds, synchronize
from yolokit.data import DetectionDataset, build_dataloader, make_shapes

IMAGE_KEYS = ("images", "images_uint8", "img")


def dataset_yaml(*, images: int, imgsz: int) -> Path:
    """The shapes set with ``images`` training images of long side ``imgsz`` (generated once, cached)."""
    return make_shapes(n_train=images, n_val=16, imgsz=imgsz, seed=0)


COCO_TRAIN = 118_287   # images in COCO's train2017


def coco_sized_yaml(root: Path, *, images: int = COCO_TRAIN, distinct: int = 512, val: int = 256,
                    seed: int = 0) -> Path:
    """A detection set of COCO's size and shape, generated once under ``root``: ``images`` training
    images (640x480 photo-like JPEGs, ~100 KB, with 1-15 boxes of 80 classes, many small, as
    COCO's ~7 a picture) that are hard links to ``distinct`` generated ones, each with its own
    label file; ``val`` more images for validation. Every name is indexed, read and decoded as a
    real file; only the page cache sees fewer bytes than COCO's 19 GB (a machine with 128 GB of
    memory holds COCO in it after one epoch anyway)."""
    import numpy as np

    yaml, done = root / "data.yaml", root / "complete"
    if done.is_file() and done.read_text() == f"{images} {distinct} {val} {seed}":
        return yaml
    for folder in ("images", "labels", "distinct"):   # another size's files, or a run cut short
        shutil.rmtree(root / folder, ignore_errors=True)
    done.unlink(missing_ok=True)
    rng = np.random.default_rng(seed)
    made = root / "distinct"
    for folder in (made, root / "images" / "train", root / "labels" / "train", root / "images" / "val",
                   root / "labels" / "val"):
        folder.mkdir(parents=True, exist_ok=True)

    def draw(stem: Path) -> None:   # median ~0.1 of the side: many small boxes, as COCO's
        photo_like(rng, stem.with_suffix(".jpg"), stem.with_suffix(".txt"), boxes=(1, 16), classes=80,
                   sizes=lambda: np.minimum(rng.lognormal(-2.3, 0.8, 2), 0.9))

    for i in range(distinct):
        draw(made / f"{i:06d}")
    for i in range(val):
        draw(made / f"val{i:06d}")
        for suffix, folder in ((".jpg", "images"), (".txt", "labels")):
            _replace_link(made / f"val{i:06d}{suffix}", root / folder / "val" / f"{i:06d}{suffix}")
    for i in range(images):
        for suffix, folder in ((".jpg", "images"), (".txt", "labels")):
            _replace_link(made / f"{i % distinct:06d}{suffix}", root / folder / "train" / f"{i:06d}{suffix}")
    names = ", ".join(f"c{k}" for k in range(80))
    yaml.write_text(f"path: {root}\ntrain: images/train\nval: images/val\nnames: [{names}]\n")
    done.write_text(f"{images} {distinct} {val} {seed}")
    return yaml


def photo_like(rng, image_path: Path, label_path: Path, *, boxes: tuple[int, int], classes: int, sizes) -> None:
    """A 640x480 JPEG photo-like in size and decode cost (a gradient, filled rectangles, grain;
    about 100 KB) and its YOLO labels: ``boxes`` [low, high) rectangles of ``classes`` classes,
    each (w, h) from ``sizes()``, drawn from ``rng``."""
    import cv2
    import numpy as np

    base = np.linspace(0, 255, 640, dtype=np.float32)[None, :, None] * np.ones((480, 1, 3), np.float32)
    image = (base * rng.uniform(0.3, 1.0, 3) + rng.uniform(0, 60, 3)).clip(0, 255).astype(np.uint8)
    rows = []
    for _ in range(int(rng.integers(*boxes))):
        w, h = sizes()
        cx, cy = rng.uniform(w / 2, 1 - w / 2), rng.uniform(h / 2, 1 - h / 2)
        c = int(rng.integers(0, classes))
        p1 = (int((cx - w / 2) * 640), int((cy - h / 2) * 480))
        p2 = (int((cx + w / 2) * 640), int((cy + h / 2) * 480))
        cv2.rectangle(image, p1, p2, [int(v) for v in rng.integers(0, 255, 3)], -1)
        rows.append(f"{c} {cx:.6f} {cy:.6f} {w:.6f} {h:.6f}")
    noise = rng.normal(0, 6, image.shape[:2] + (1,))          # texture: photo-like file sizes and decode cost
    image = (image + noise).clip(0, 255).astype(np.uint8)
    cv2.imwrite(str(image_path), image, [cv2.IMWRITE_JPEG_QUALITY, 90])
    label_path.write_text("\n".join(rows) + "\n")


def _replace_link(source: Path, name: Path) -> None:
    """``name`` a hard link to ``source`` (a copy where the file system has no hard links)."""
    name.unlink(missing_ok=True)
    try:
        os.link(source, name)
    except OSError:
        name.write_bytes(source.read_bytes())


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
                   hsv_on_device: bool = False, segments: bool = False, persistent: bool = False):
    """yolokit's training loader as the trainer builds it (``uint8_images`` by default; on CUDA
    the trainer also passes ``hsv_on_device``), and a function timing ``count`` batches after
    ``warmup`` on fresh workers. ``segments``: a segmentation set's items, masks drawn. ``persistent``:
    the trainer's persistent workers, each run on the workers (and what they keep) of the runs before."""
    dataset = DetectionDataset(yaml, "train", imgsz=imgsz, augment=True, segments=segments)
    loader = build_dataloader(dataset, batch, workers=workers, seed=0, uint8_images=uint8,
                              persistent_workers=persistent, pin_memory=False, hsv_on_device=hsv_on_device)

    def run(count: int, warmup: int) -> Timed:
        batches = iter(loader)
        try:
            return time_batches(batches, count, warmup)
        finally:
            del batches  # a non-persistent iterator shuts its workers down when dropped

    return run, loader


def hsv_step_seconds(batch: int, imgsz: int, device, rounds: int = 5, compiled: bool = False) -> float:
    """Seconds of `to_device`'s HSV step (``apply_hsv_lut_batch``, ``compiled`` or not) on a uint8 batch at
    imgsz on ``device``: the median of ``rounds`` after one untimed round (which compiles, if asked)."""
    import numpy as np
    import torch

    from yolokit.data.augment.color import apply_hsv_lut_batch
    from yolokit.data.augment.transforms import hsv_lut

    rng = np.random.default_rng(0)
    images = torch.randint(0, 256, (batch, 3, imgsz, imgsz), dtype=torch.uint8, device=device)
    luts = torch.from_numpy(np.stack([hsv_lut(rng) for _ in range(batch)])).to(device)
    times = []
    for _ in range(rounds + 1):
        synchronize(images.device)
        start = time.perf_counter()
        apply_hsv_lut_batch(images, luts, compiled=compiled)
        synchronize(images.device)
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:]))
