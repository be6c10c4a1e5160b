"""The augmentation on the device (``augment_on="device"``): the batched pass and the JPEG decode alone.

The shapes set at 640 with the default augmentation (Mosaic, HSV, flips) and MixUp at 0.5 so
both views are warped: the loader's main process makes a batch of 64 recipes (JPEG bytes and
numbers; `yolokit.data.recipes`), then `device_augment.augment_batch` (nvJPEG decode, resize,
Mosaic + warp, MixUp, HSV, flips) and `decode_sources` alone are timed on the device from that
batch, in turns. Also the device memory one pass takes at its peak, and what the loader's
side costs per image on the CPU, recipes against the workers' OpenCV images.
"""

from __future__ import annotations

import time

import torch
from harness.timing import synchronize

from gpu.common import Clock, Row, Settings, images_per_second, shapes_yaml


def _loader(s: Settings, augment_on: str, batch: int):
    from yolokit.data import AugmentConfig, DetectionDataset, build_dataloader

    dataset = DetectionDataset(shapes_yaml(s), "train", imgsz=s.imgsz, augment=True, hyp=AugmentConfig(mixup=0.5))
    return build_dataloader(dataset, batch, workers=0, seed=0, uint8_images=True, pin_memory=s.cuda,
                            augment_on=augment_on)


def _loader_seconds_per_image(s: Settings, augment_on: str, batch: int) -> float:
    """The main process's seconds per image of the second batch (the first fills the recent-image buffer)."""
    batches = iter(_loader(s, augment_on, batch))
    next(batches)
    start = time.perf_counter()
    got = next(batches)
    return (time.perf_counter() - start) / len(got["indices"])


def device_pass(s: Settings, clock: Clock) -> list[Row]:
    from yolokit.data.device_augment import augment_batch, decode_sources

    n = s.batch(64)
    batch = next(iter(_loader(s, "device", n)))
    whole = lambda: augment_batch(batch, s.device)           # noqa: E731
    decode = lambda: decode_sources(batch, s.device)          # noqa: E731
    pass_ips, decode_ips = images_per_second(s, [whole, decode], n)
    peak = None
    if s.cuda:
        synchronize(s.device)
        torch.cuda.reset_peak_memory_stats(s.device)
        before = torch.cuda.memory_allocated(s.device)
        whole()
        synchronize(s.device)
        peak = (torch.cuda.max_memory_allocated(s.device) - before) / 2**20 / n
    mixed = int((batch["aug_mix"] < 1).sum())
    rows = [Row("augment", f"device pass img/s (decode..HSV, batch {n}, {mixed} MixUp)", pass_ips, "img/s",
                data={"images_per_s": pass_ips, "mixup_images": mixed, "imgsz": s.imgsz}),
            Row("augment", f"JPEG decode alone img/s (batch {n}, {len(batch['aug_jpeg']) / 2**20:.1f} MiB)",
                decode_ips, "img/s", data={"images_per_s": decode_ips}),
            Row("augment", "device pass peak memory per image", peak, "MiB",
                note="n/a on the CPU" if peak is None else "", data={"mib_per_image": peak})]
    if clock.over():
        return rows + [clock.skipped("loader CPU seconds per image: OpenCV images / recipes")]
    workers = _loader_seconds_per_image(s, "workers", n)
    device = _loader_seconds_per_image(s, "device", n)
    print(f"  loader main process: {1e3 * workers:.1f} ms per image making images, {1e3 * device:.2f} ms "
          f"making recipes; device pass {pass_ips:.0f} img/s, decode {decode_ips:.0f} img/s", flush=True)
    return rows + [Row("augment", "loader CPU seconds per image: OpenCV images / recipes", workers / device, "x",
                       data={"workers_ms": 1e3 * workers, "recipes_ms": 1e3 * device})]
