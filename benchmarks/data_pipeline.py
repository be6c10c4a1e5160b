"""Images per second of the full training data pipeline, yolokit vs Ultralytics.

Decode, Mosaic, random affine, HSV, flip and collate at 640 px with the YOLOv8 default
augmentation, on the built-in shapes set generated at 640 px. Not a test: run it by
hand, ideally on an otherwise idle machine.

    python benchmarks/data_pipeline.py                      # yolokit only
    /path/to/venv-with-ultralytics/bin/python benchmarks/data_pipeline.py --ultralytics

Ultralytics is imported only with --ultralytics (through ``harness.reference``), from
whatever interpreter runs the script (keep it out of yolokit's environment). Its batches are
uint8 (it converts to float on the GPU later); yolokit's are float32 in [0, 1] by the
batch contract, converted in the workers. `--uint8` also times yolokit with
`uint8_images=True` (uint8 batches, converted on the device by `to_device`, as Ultralytics does),
and `--hsv-on-device` with `hsv_on_device=True` as well (what the trainer does on CUDA: the
workers draw each image's HSV gains, `to_device` applies them on the GPU; that step is not in
these figures, which time the loader alone: `--device-hsv-cost` times it on this machine's torch).
`--augment-on-device` also times yolokit with `augment_on="device"`: the workers read each file's
bytes, draw the numbers and make the labels, and ship recipes; the pixels (decode, Mosaic, warp,
HSV, flips) are made by `to_device` on the training device, which these figures leave out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from harness.pipeline import epochs, hsv_step_seconds, time_batches
from harness.timing import header


def yolokit_loader(yaml, args, *, uint8: bool = False, hsv_on_device: bool = False, augment_on: str = "workers"):
    from yolokit.data import DetectionDataset, build_dataloader

    ds = DetectionDataset(yaml, "train", imgsz=args.imgsz, augment=True, cache_images=args.cache or False)
    device = augment_on == "device"
    return build_dataloader(ds, args.batch, workers=args.workers, seed=0,
                            uint8_images=uint8 or hsv_on_device or device, hsv_on_device=hsv_on_device,
                            augment_on=augment_on)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--images", type=int, default=256, help="training images in the set")
    p.add_argument("--batches", type=int, default=40, help="timed batches per run")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3, help="runs per loader, interleaved")
    p.add_argument("--ultralytics", action="store_true", help="also time Ultralytics' loader")
    p.add_argument("--uint8", action="store_true", help="also time yolokit with uint8_images=True")
    p.add_argument("--hsv-on-device", action="store_true",
                   help="also time yolokit with uint8_images and hsv_on_device (the trainer on CUDA)")
    p.add_argument("--augment-on-device", action="store_true",
                   help="also time yolokit with augment_on='device' (the workers ship recipes; pixels on the device)")
    p.add_argument("--device-hsv-cost", default=None, metavar="DEVICE",
                   help="also time the HSV step of to_device on DEVICE (cpu, cuda)")
    p.add_argument("--photos", action="store_true",
                   help="640x480 JPEGs of photo-like size (scan.py's folder) instead of the shapes set")
    p.add_argument("--cache", choices=["ram", "disk"], help="the image cache, on both sides")
    args = p.parse_args()

    from yolokit.data import make_shapes

    if args.photos:
        from scan import make_folder

        yaml = make_folder(Path(f"/tmp/yolokit-photos-v2/{args.images}"), args.images)
    else:
        yaml = make_shapes(n_train=args.images, n_val=16, imgsz=args.imgsz, seed=0)
    extra = {}
    runs = {"yolokit": lambda: yolokit_loader(yaml, args)}
    if args.uint8:
        runs["yolokit uint8_images"] = lambda: yolokit_loader(yaml, args, uint8=True)
    if args.hsv_on_device:
        runs["yolokit hsv_on_device"] = lambda: yolokit_loader(yaml, args, hsv_on_device=True)
    if args.augment_on_device:
        runs["yolokit augment_on device"] = lambda: yolokit_loader(yaml, args, augment_on="device")
    if args.ultralytics:
        from harness import reference

        extra["ultralytics"] = reference.version()
        runs["ultralytics"] = lambda: reference.training_loader(yaml, imgsz=args.imgsz, batch=args.batch,
                                                                workers=args.workers, cache=args.cache or False)
    loaders = {name: make() for name, make in runs.items()}
    results = {name: [] for name in loaders}
    for _ in range(args.repeats):  # interleave, so load from elsewhere hits all alike
        for name, loader in loaders.items():  # each run from a new epoch; epochs repeat as needed
            timed = time_batches(epochs(loader), args.batches, args.warmup, loader=loader,
                                 key="aug_mix" if name.endswith("augment_on device") else None)
            results[name].append((timed.units / timed.seconds, timed.cpu_seconds / timed.units * 1000))

    print(header(extra))
    print(f"data: {yaml.parent} ({args.images} train images), cache {args.cache or 'off'}")
    print(f"setting: imgsz {args.imgsz}, batch {args.batch}, workers {args.workers}, "
          f"YOLOv8 default augmentation (Mosaic 1.0, translate 0.1, scale 0.5, HSV, fliplr 0.5)")
    print(f"{'loader':<24}{'img/s (median)':>16}{'CPU ms/img (median)':>21}   runs img/s")
    for name, vals in results.items():
        rates, cpu = [v[0] for v in vals], [v[1] for v in vals]
        runs_text = " ".join(f"{v:.1f}" for v in rates)
        print(f"{name:<24}{np.median(rates):>16.1f}{np.median(cpu):>21.2f}   {runs_text}")
    print("CPU ms/img: user+system time of the main process and the timed loader's workers per image; "
          "less sensitive than img/s to other load on the machine.")
    if args.hsv_on_device:
        print("yolokit hsv_on_device: the HSV step is left to to_device (on the training device), "
              "so it is not in its figures.")
    if args.augment_on_device:
        print("yolokit augment_on device: the workers' side only (file bytes, numbers, labels); the pixels are "
              "made by to_device on the training device, not in these figures.")
    if args.device_hsv_cost:
        print(f"to_device's HSV step on {args.device_hsv_cost}, batch {args.batch} at {args.imgsz}: "
              f"{hsv_step_seconds(args.batch, args.imgsz, args.device_hsv_cost) / args.batch * 1000:.2f} ms per image")


if __name__ == "__main__":
    main()
