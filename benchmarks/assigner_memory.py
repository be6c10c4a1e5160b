"""Peak memory and time of the task-aligned assigner and the YOLOv8 loss, normal and dense scenes.

Each measurement runs in a fresh Python process: the inputs (random per-level maps of a
640 px batch, 80 classes, and random GT boxes) are built first, then one call's peak
memory above them is read as the rise of the peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs``; see ``harness.timing.peak_memory``), and the calls are
timed (median and min after a warm-up call). Not a test: run it by hand on a quiet machine.

    python benchmarks/assigner_memory.py                           # normal and dense
    python benchmarks/assigner_memory.py --cases dense --repeats 3
    python benchmarks/assigner_memory.py --set chunk_pairs=0        # assigner attribute override

Cases (``harness.inputs``: maps N(0, 1), boxes 16 to 320 px unless --max-wh):
``normal`` is batch 16 with 10 boxes per image, ``dense`` batch 16 with 1,000.
Rows: ``loss`` = ``YOLOv8Loss`` forward + backward (assignment included, from the
per-level maps to their gradients); ``loss-G`` the same with ``max_boxes`` given (the most
boxes in one image: padded targets); ``assigner`` = ``TaskAlignedAssigner.assign_rows``
on the decoded predictions and class logits the loss hands it, targets padded.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch
from harness.inputs import STRIDES, random_targets, v8_maps
from harness.timing import alternate, header, median, peak_memory

CASES = {"normal": 10, "dense": 1000}


def _inputs(per_image: int, batch: int, size: int, classes: int, max_wh: float):
    maps = v8_maps(batch, size, classes=classes)
    targets = random_targets(batch, per_image, size, classes=classes, max_wh=max_wh)
    return maps, targets, STRIDES


def _child(args: argparse.Namespace) -> dict:
    """One row in this process: peak memory of one call, then its timings."""
    from yolokit.losses import YOLOv8Loss, pad_targets
    from yolokit.ops.anchors import dist_to_box, grid_points

    if args.threads:
        torch.set_num_threads(args.threads)
    maps, targets, strides = _inputs(CASES[args.case], args.batch, args.imgsz, args.classes, args.max_wh)
    loss = YOLOv8Loss(args.classes, strides)
    for item in args.set:
        name, value = item.split("=", 1)
        setattr(loss.assigner, name, json.loads(value))

    if args.row in ("loss", "loss-G"):
        kwargs = {"max_boxes": CASES[args.case]} if args.row == "loss-G" else {}

        def fn() -> None:
            leaves = [m.detach().requires_grad_() for m in maps]
            total, _ = loss(leaves, targets, **kwargs)
            total.backward()
    else:
        b = args.batch
        points, point_strides = grid_points([tuple(m.shape[-2:]) for m in maps], strides)
        flat = torch.cat([m.flatten(2) for m in maps], 2)  # [B, 64 + C, P]
        dist = torch.matmul(torch.arange(16.0), flat[:, :64].view(b, 4, 16, -1).softmax(2)).transpose(1, 2)
        boxes = dist_to_box(dist * point_strides[:, None], points)
        logits = flat[:, 64:].contiguous().transpose(1, 2)  # as the loss passes them
        gt = pad_targets(targets, b)

        def fn() -> None:
            loss.assigner.assign_rows(logits, boxes, points, *gt.rows(), per_image=gt.labels.shape[1], logits=True)

    fn()  # warm-up (one-time allocations: thread pools, kernels)
    peak = peak_memory(fn)
    times = alternate([fn], warmup=0, repeats=args.repeats)[0]
    return {"peak_mib": None if peak is None else peak / 2**20, "median_ms": median(times) * 1e3,
            "min_ms": min(times) * 1e3, "runs_ms": [t * 1e3 for t in times]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=["normal", "dense"])
    rows = ["assigner", "loss", "loss-G"]
    parser.add_argument("--rows", nargs="+", choices=rows, default=rows)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--classes", type=int, default=80)
    parser.add_argument("--max-wh", type=float, default=320.0, help="largest GT side in pixels (smallest: 16)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=JSON",
                        help="set an attribute of the loss's assigner before measuring (repeatable)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--row", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args)))
        return

    print(header())
    print(f"batch {args.batch}, {args.imgsz} px, {args.classes} classes, boxes 16 to {args.max_wh:g} px; "
          f"median (min) of {args.repeats} runs after 1 warm-up; peak = extra resident memory of one call\n")
    passthrough = sys.argv[1:]
    for case in args.cases:
        for row in args.rows:
            out = subprocess.run([sys.executable, __file__, *passthrough, "--child", "--case", case, "--row", row],
                                 check=True, capture_output=True, text=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f} MiB"
            label = f"{case} ({CASES[case]} boxes/image) {row}"
            print(f"{label:<36} peak {peak:>10}   {r['median_ms']:9.1f} ms ({r['min_ms']:.1f})   "
                  f"runs {', '.join(f'{t:.0f}' for t in r['runs_ms'])}", flush=True)


if __name__ == "__main__":
    main()
