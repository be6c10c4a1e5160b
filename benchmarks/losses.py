"""Speed of the detection losses: assignment alone, and loss forward + backward.

Random raw maps shaped like a 640 px batch of the real heads (80 classes) and random
GT boxes (16 to 320 px), from ``harness.inputs``, stand in for a model, so only the loss
is timed.

    python benchmarks/losses.py                      # batch 16, 640 px, 10 GT per image
    python benchmarks/losses.py --gt 200 --repeats 5 --threads 2

Prints the machine, library versions and the command, then one line per case with the
median and min over the timed runs (after warm-up rounds; the cases run in turns).
"""

from __future__ import annotations

import argparse

import torch
from harness import inputs
from harness.timing import alternate, header, median

from yolokit.losses import TaskAlignedAssigner, YOLOv3Loss, YOLOv8Loss, pad_targets
from yolokit.ops.anchors import dist_to_box, grid_points

V3_ANCHORS = (((10, 13), (16, 30), (33, 23)), ((30, 61), (62, 45), (59, 119)), ((116, 90), (156, 198), (373, 326)))


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

    print(header())
    print(f"batch {args.batch}, {args.imgsz} px, {args.gt} GT per image, {args.classes} classes; "
          f"median (min) of {args.repeats} runs after {args.warmup} warm-up rounds, the cases in turns\n")

    b, c, size = args.batch, args.classes, args.imgsz
    targets = inputs.random_targets(b, args.gt, size, classes=c)

    # YOLOv8: maps [B, 64 + C, H, W]
    v8_maps = inputs.v8_maps(b, size, classes=c)
    shapes = [tuple(m.shape[-2:]) for m in v8_maps]
    v8_loss = YOLOv8Loss(c, inputs.STRIDES)
    points, point_strides = grid_points(shapes, inputs.STRIDES)
    flat = torch.cat([m.flatten(2) for m in v8_maps], 2).transpose(1, 2)
    dist = flat[..., :64].reshape(b, -1, 4, 16).softmax(-1) @ torch.arange(16.0)
    boxes = dist_to_box(dist * point_strides[:, None], points)
    scores = flat[..., 64:].sigmoid()
    assigner = TaskAlignedAssigner()

    def assign() -> None:   # what the loss runs: the padded rows, predictions read in place
        padded = pad_targets(targets, b)
        assigner.assign_rows(scores, boxes, points, *padded.rows(), per_image=padded.labels.shape[1])

    def v8_step() -> None:
        maps = [m.detach().requires_grad_() for m in v8_maps]
        total, _ = v8_loss(maps, targets)
        total.backward()

    # YOLOv3: maps [B, 3 * (5 + C), H, W]
    v3_maps = [m * 0.5 for m in inputs.v8_maps(b, size, classes=3 * (5 + c) - 64, seed=1)]
    v3_loss = YOLOv3Loss(c, V3_ANCHORS, inputs.STRIDES)

    def v3_step() -> None:
        maps = [m.detach().requires_grad_() for m in v3_maps]
        total, _ = v3_loss(maps, targets)
        total.backward()

    cases = [
        (f"TaskAlignedAssigner assign_rows (P={len(points)})", assign),
        ("YOLOv8Loss forward + backward (incl. assignment)", v8_step),
        (f"YOLOv3Loss forward + backward (ciou, Q={sum(3 * h * w for h, w in shapes)})", v3_step),
    ]
    runs = alternate([fn for _, fn in cases], warmup=args.warmup, repeats=args.repeats)
    for (name, _), times in zip(cases, runs, strict=True):
        print(f"{name:<62} {median(times) * 1e3:8.1f} ms  ({min(times) * 1e3:.1f})")


if __name__ == "__main__":
    main()
