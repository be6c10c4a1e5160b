"""Speed of the detection losses: assignment alone, and loss forward + backward.

Random raw maps shaped like a 640 px batch of the real heads (80 classes) and random
GT boxes (16 to 320 px) stand in for a model, so only the loss is timed.

    python benchmarks/losses.py                      # batch 16, 640 px, 10 GT per image
    python benchmarks/losses.py --gt 200 --repeats 5 --threads 2

Prints the machine, library versions and the command, then one line per case with the
median and min over the timed runs (after warm-up runs).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

from yolokit.losses import TaskAlignedAssigner, YOLOv3Loss, YOLOv8Loss, pad_targets
from yolokit.ops.anchors import dist_to_box, grid_points

V3_ANCHORS = (((10, 13), (16, 30), (33, 23)), ((30, 61), (62, 45), (59, 119)), ((116, 90), (156, 198), (373, 326)))
STRIDES = (8, 16, 32)


def _targets(gen: torch.Generator, batch: int, per_image: int, size: int, classes: int) -> torch.Tensor:
    n = batch * per_image
    wh = 16 + torch.rand(n, 2, generator=gen) * 304
    xy = torch.rand(n, 2, generator=gen) * (size - wh)
    image = torch.arange(batch).repeat_interleave(per_image).float()
    cls = torch.randint(0, classes, (n,), generator=gen).float()
    return torch.cat([image[:, None], cls[:, None], xy, xy + wh], dim=1)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _time(fn, warmup: int, repeats: int) -> tuple[float, float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--gt", type=int, default=10, help="GT boxes per image")
    parser.add_argument("--classes", type=int, default=80)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    print(f"command: python {' '.join(sys.argv)}")
    print(f"machine: {_cpu_name()}, {os.cpu_count()} cores; "
          f"load average {os.getloadavg()[0]:.1f}; torch threads {torch.get_num_threads()}")
    print(f"python {platform.python_version()}, torch {torch.__version__}, {platform.platform()}")
    print(f"batch {args.batch}, {args.imgsz} px, {args.gt} GT per image, {args.classes} classes; "
          f"median (min) of {args.repeats} runs after {args.warmup} warm-up\n")

    gen = torch.Generator().manual_seed(0)
    b, c, size = args.batch, args.classes, args.imgsz
    shapes = [(size // s, size // s) for s in STRIDES]
    targets = _targets(gen, b, args.gt, size, c)

    # YOLOv8: maps [B, 64 + C, H, W]
    v8_maps = [torch.randn(b, 64 + c, h, w, generator=gen) for h, w in shapes]
    v8_loss = YOLOv8Loss(c, STRIDES)
    points, point_strides = grid_points(shapes, STRIDES)
    flat = torch.cat([m.flatten(2) for m in v8_maps], 2).transpose(1, 2)
    dist = flat[..., :64].reshape(b, -1, 4, 16).softmax(-1) @ torch.arange(16.0)
    boxes = dist_to_box(dist * point_strides[:, None], points)
    scores = flat[..., 64:].sigmoid()
    assigner = TaskAlignedAssigner()

    def assign() -> None:
        assigner(scores, boxes, points, *pad_targets(targets, b))

    def v8_step() -> None:
        maps = [m.detach().requires_grad_() for m in v8_maps]
        total, _ = v8_loss(maps, targets)
        total.backward()

    # YOLOv3: maps [B, 3 * (5 + C), H, W]
    v3_maps = [torch.randn(b, 3 * (5 + c), h, w, generator=gen) * 0.5 for h, w in shapes]
    v3_loss = YOLOv3Loss(c, V3_ANCHORS, STRIDES)

    def v3_step() -> None:
        maps = [m.detach().requires_grad_() for m in v3_maps]
        total, _ = v3_loss(maps, targets)
        total.backward()

    cases = [
        (f"TaskAlignedAssigner forward (P={len(points)})", assign),
        ("YOLOv8Loss forward + backward (incl. assignment)", v8_step),
        (f"YOLOv3Loss forward + backward (ciou, Q={sum(3 * h * w for h, w in shapes)})", v3_step),
    ]
    for name, fn in cases:
        median, best = _time(fn, args.warmup, args.repeats)
        print(f"{name:<62} {median * 1e3:8.1f} ms  ({best * 1e3:.1f})")


if __name__ == "__main__":
    main()
