"""The training loader with masks against the same set read for boxes only: wall and CPU time per image.

    python benchmarks/seg_loader.py [--runs 7] [--imgsz 640] [--workers 2]

Both loaders as the trainer builds them (``harness.pipeline.yolokit_loader``) on a generated shapes-seg set, in
alternating runs of 16 batches after 3 on fresh workers; the CPU time counts the main process and the workers
(steadier than the wall clock on a shared machine). Prints the medians (and minimums) per image, their ratio,
and the median of the ratios of each pair of runs (run side by side: the steadiest figure on a noisy machine).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.pipeline import yolokit_loader  # noqa: E402
from harness.timing import header  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=16)
    args = parser.parse_args()
    from yolokit.data import make_shapes

    print(header())

    batch, warmup = 16, 3
    yaml = make_shapes(n_train=(args.batches + warmup) * batch, n_val=16, imgsz=args.imgsz, seed=0, segments=True)
    loaders = {masks: yolokit_loader(yaml, imgsz=args.imgsz, batch=batch, workers=args.workers, segments=masks)[0]
               for masks in (True, False)}
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in range(args.runs):
        for masks, run in loaders.items():
            t = run(args.batches, warmup)
            times[masks].append((t.seconds / t.units * 1000, (t.cpu_seconds or 0.0) / t.units * 1000))
    stats = {}
    for masks, values in times.items():
        wall, cpu = (sorted(v[k] for v in values) for k in (0, 1))
        stats[masks] = (wall[len(wall) // 2], wall[0], cpu[len(cpu) // 2], cpu[0])
    print(f"| loader at {args.imgsz} px, batch {batch}, {args.workers} workers | wall ms/image, median (min) "
          "| CPU ms/image, median (min) |\n|---|---:|---:|")
    for masks, label in ((True, "with masks"), (False, "boxes only")):
        w, w0, c, c0 = stats[masks]
        print(f"| {label} | {w:.2f} ({w0:.2f}) | {c:.2f} ({c0:.2f}) |")
    (w1, w10, c1, c10), (w2, w20, c2, c20) = stats[True], stats[False]
    print(f"| ratio of the medians (of the minimums) | {w1 / w2:.2f}x ({w10 / w20:.2f}x) | {c1 / c2:.2f}x "
          f"({c10 / c20:.2f}x) |")
    pairs = [[a[k] / b[k] for a, b in zip(times[True], times[False], strict=True)] for k in (0, 1)]
    print(f"| ratio, median of the {args.runs} pairs of runs | **{np.median(pairs[0]):.2f}x** | "
          f"**{np.median(pairs[1]):.2f}x** |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
