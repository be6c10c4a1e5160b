"""One device-augmentation batch and one training step, small enough to run under compute-sanitizer.

    python benchmarks/gpu/sanitize.py                       # CUDA when available, else the CPU
    python benchmarks/gpu/sanitize.py --device cpu --imgsz 128 --batch 4
    compute-sanitizer --tool memcheck python3 benchmarks/gpu/sanitize.py --imgsz 160 --batch 4

The correct-on-GPU command (``benchmarks/gpu.py --plan`` prints it first) runs this script
under ``compute-sanitizer --tool memcheck`` and then ``--tool initcheck``, where every kernel
runs 10-100 times slower; so the sizes are small (yolov8n, a few images of 128-256 px).

What it runs, in the trainer's order: a shapes set of 16 training images at ``--imgsz`` is made
in a temporary folder; one batch comes from a device-augmentation loader (``augment_on="device"``,
Mosaic, and MixUp on every image so that both views are warped; no workers; pinned memory on
CUDA, as the trainer has it); ``yolokit.data.to_device`` turns it into images on the device
(``device_augment.augment_batch``: nvJPEG decode, resize, Mosaic and warp, MixUp, HSV, flips)
with the batch's targets; then one training step of yolov8n (bf16 on CUDA, fp32 on the CPU):
``train.step.forward_backward``, ``Precision.step`` with clipping at norm 10, ``zero_grad``.
The device is synchronized after the augmentation and after the step, so that an error raised
by a kernel (a device-side assert) surfaces in the part that queued it. cuDNN's benchmark mode
stays off: it would try many kernels, each slow under the sanitizer.

It prints one line per part with its seconds, then one summary line: the images' shape and
dtype, how many images MixUp blended, the loss and whether it is finite. Exit status 0 when
the loss is finite, 1 when it is not.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

TRAIN_IMAGES = 16   # the temporary shapes set's: a Mosaic or MixUp sample draws its other images from them
# Why initcheck runs the device augmentation alone: on an H200 (2026-11-27) it took 11-30 s for the
# augmentation and had not finished yolov8n's first forward 50 s later, at 96 px and 2 images as at 160
# px and 4, with PyTorch's caching allocator on or off. The step's uninitialised reads are guarded on the
# CPU instead (tests/train/test_step_syncs.py: the step under torch's fill_uninitialized_memory), and
# memcheck runs the step here (20 s).
NO_STEP_REASON = "initcheck does not finish a training step in its time"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available, else cpu)")
    parser.add_argument("--imgsz", type=int, default=192, help="training size in pixels (default 192)")
    parser.add_argument("--batch", type=int, default=4, help="images in the batch (default 4)")
    parser.add_argument("--no-step", action="store_true",
                        help="the device augmentation only, no training step (initcheck: see NO_STEP_REASON)")
    args = parser.parse_args(argv)
    # Ctrl-C, or timeout's SIGINT at a step's limit, ends the run with a traceback of where it was, also
    # when the shell that started it ignores SIGINT (as a background job's does)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    from yolokit.accel.amp import Precision
    from yolokit.data import AugmentConfig, DetectionDataset, build_dataloader, make_shapes, to_device
    from yolokit.models import create_model
    from yolokit.train import TrainConfig
    from yolokit.train.build import build_loss
    from yolokit.train.optim import build_optimizer
    from yolokit.train.step import forward_backward

    start = time.perf_counter()

    def done(part: str) -> None:
        print(f"sanitize: {part} ({time.perf_counter() - start:.1f} s)", flush=True)

    print(f"sanitize: device {device}, imgsz {args.imgsz}, batch {args.batch}, torch {torch.__version__}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="yolokit-sanitize-") as tmp:
        yaml = make_shapes(Path(tmp) / "shapes", n_train=TRAIN_IMAGES, n_val=2, imgsz=args.imgsz, seed=0)
        dataset = DetectionDataset(yaml, "train", imgsz=args.imgsz, augment=True, hyp=AugmentConfig(mixup=1.0))
        loader = build_dataloader(dataset, args.batch, workers=0, seed=0, uint8_images=True,
                                  pin_memory=device.type == "cuda", augment_on="device")
        batch = next(iter(loader))      # the recipes: JPEG bytes and numbers, read before the folder goes
    mixed = int((torch.as_tensor(batch["aug_mix"]) < 1).sum())
    done(f"one recipe batch of {len(batch['indices'])} images ({mixed} with MixUp)")

    data = to_device(batch, device, non_blocking=True)    # augment_batch on the device, targets copied
    synchronize(device)
    images, targets = data["images"], data["targets"]
    done(f"device augmentation: images {tuple(images.shape)}, {len(targets)} boxes")

    if args.no_step:
        print(f"sanitize: done on {device}: images {tuple(images.shape)} from uint8, {mixed} MixUp, no training "
              f"step (--no-step), {time.perf_counter() - start:.1f} s", flush=True)
        return 0
    model = create_model("yolov8n", num_classes=len(dataset.names)).to(device).train()
    criterion = build_loss(model, TrainConfig(model="yolov8n"))
    amp = Precision("bf16" if device.type == "cuda" else "fp32", device)
    optimizer = build_optimizer(model, "sgd", 0.01, 0.937, 5e-4)
    loss, _ = forward_backward(model, criterion, amp, images, targets, max_boxes=batch["max_boxes"],
                               weight=float(len(images)), channels_last=False)
    amp.step(optimizer, clip_grad_norm=10.0, blocking=False)
    optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    value = float(loss)
    done(f"one training step of yolov8n in {amp.precision}")

    finite = math.isfinite(value)
    print(f"sanitize: done on {device}: images {tuple(images.shape)} from uint8, {mixed} MixUp, "
          f"loss {value:.4f}, finite {finite}, {time.perf_counter() - start:.1f} s", flush=True)
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())
