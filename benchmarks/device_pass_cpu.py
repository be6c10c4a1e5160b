"""The device augmentation pass on the CPU, eager and compiled: speed and the bytes it allocates.

A CPU proxy for the GPU pass's `fused` section: the same stages (decode, resize, warp, MixUp,
HSV) on one batch of Mosaic + MixUp recipes, timed eagerly and through ``torch.compile``
(`yolokit.data.augment.fused`; the first call compiles, untimed), and each run's allocations from the
allocator's own records (the profiler's ``[memory]`` events), over the output's bytes. Not a
test: run it on a quiet machine.

    python benchmarks/device_pass_cpu.py
    python benchmarks/device_pass_cpu.py --imgsz 640 --batch 8 --repeats 3
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from harness.timing import allocations

from yolokit.data import AugmentConfig, DetectionDataset, build_dataloader, make_shapes
from yolokit.data.augment.device_augment import augment_batch


def allocated(batch: dict, compiled: bool) -> tuple[float, float]:
    """Bytes allocated and the peak held during one pass, each over the output's bytes."""
    out, total, peak = allocations(lambda: augment_batch(batch, "cpu", compiled=compiled))
    return total / out.numel(), peak / out.numel()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--imgsz", type=int, default=320)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5, help="timed passes per mode")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        yaml = make_shapes(Path(tmp) / "set", seed=0, n_train=2 * args.batch, n_val=2, imgsz=args.imgsz)
        ds = DetectionDataset(yaml, "train", imgsz=args.imgsz, augment=True, hyp=AugmentConfig(mixup=0.5))
        batch = next(iter(build_dataloader(ds, args.batch, workers=0, seed=1, uint8_images=True,
                                           augment_on="device")))
        print(f"device pass on the CPU ({torch.get_num_threads()} threads), {args.imgsz} px Mosaic + MixUp, "
              f"batch {args.batch}, torch {torch.__version__}")
        images = {}
        for compiled in (False, True):
            for _ in range(2):                                          # the compile, then a warm pass
                images[compiled] = augment_batch(batch, "cpu", compiled=compiled)
            start = time.perf_counter()
            for _ in range(args.repeats):
                augment_batch(batch, "cpu", compiled=compiled)
            rate = args.batch * args.repeats / (time.perf_counter() - start)
            total, peak = allocated(batch, compiled)
            print(f"{'compiled' if compiled else 'eager':9s} {rate:8.1f} img/s   allocates {total:7.1f}x the "
                  f"output's bytes, peak {peak:5.1f}x")
        print(f"the same images: {torch.equal(images[False], images[True])}")


if __name__ == "__main__":
    main()
