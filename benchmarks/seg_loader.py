"""The training loader with masks against the same set read for boxes only: wall and CPU time per image.

    python benchmarks/seg_loader.py [--runs 7] [--imgsz 640] [--workers 2] [--interleaved 9] [--warm] [--persistent]

Both loaders as the trainer builds them (``harness.pipeline.yolokit_loader``) on a generated shapes-seg set, in
alternating runs of 16 batches after 3 on fresh workers; the CPU time counts the main process and the workers
(steadier than the wall clock on a shared machine). Prints the medians (and minimums) per image, their ratio,
and the median of the ratios of each pair of runs (run side by side: the steadiest figure on a noisy machine).
``--persistent``: the trainer's persistent workers, each loader's first epoch untimed, so that every run is a later
epoch (the outlines its workers resampled kept).
``--interleaved N``: also N passes over the set in this process (1 thread), the two datasets' batches (items and
collate) alternating, each pass's CPU time summed per form: the items' own cost without the workers' spread;
each pass on fresh datasets (a first epoch), and, with ``--warm``, also N epochs of the same two datasets after
a first (what a training run's later epochs cost: outlines already resampled are kept, ``OUTLINE_CACHE_BYTES``).
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
    parser.add_argument("--interleaved", type=int, default=0, metavar="PASSES")
    parser.add_argument("--warm", action="store_true", help="with --interleaved: also later epochs of one set")
    parser.add_argument("--persistent", action="store_true",
                        help="the trainer's persistent workers: each loader's first epoch untimed, then its later ones")
    args = parser.parse_args()
    from yolokit.data import make_shapes

    print(header())

    batch, warmup = 16, 3
    yaml = make_shapes(n_train=(args.batches + warmup) * batch, n_val=16, imgsz=args.imgsz, seed=0, segments=True)
    persistent = args.persistent and args.workers > 0          # no workers: nothing to keep, one process
    loaders = {masks: yolokit_loader(yaml, imgsz=args.imgsz, batch=batch, workers=args.workers, segments=masks,
                                     persistent=persistent)[0] for masks in (True, False)}
    if args.persistent:                       # the first epoch (outlines resampled, buffers filled) untimed
        for run in loaders.values():
            run(args.batches, warmup)
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in range(args.runs):
        for masks, run in loaders.items():
            t = run(args.batches, warmup)
            times[masks].append((t.seconds / t.units * 1000, (t.cpu_seconds or 0.0) / t.units * 1000))
    stats = {}
    for masks, values in times.items():
        wall, cpu = (sorted(v[k] for v in values) for k in (0, 1))
        stats[masks] = (wall[len(wall) // 2], wall[0], cpu[len(cpu) // 2], cpu[0])
    workers = f"{args.workers} persistent workers, epochs 2-{args.runs + 1}" if persistent else \
        f"{args.workers} workers"
    print(f"| loader at {args.imgsz} px, batch {batch}, {workers} | wall ms/image, median (min) "
          "| CPU ms/image, median (min) |\n|---|---:|---:|")
    for masks, label in ((True, "with masks"), (False, "boxes only")):
        w, w0, c, c0 = stats[masks]
        print(f"| {label} | {w:.2f} ({w0:.2f}) | {c:.2f} ({c0:.2f}) |")
    (w1, w10, c1, c10), (w2, w20, c2, c20) = stats[True], stats[False]
    print(f"| ratio of the medians (of the minimums) | {ratio(w1, w2)} ({ratio(w10, w20)}) | {ratio(c1, c2)} "
          f"({ratio(c10, c20)}) |")
    pairs = [[a[k] / b[k] for a, b in zip(times[True], times[False], strict=True) if b[k]] for k in (0, 1)]
    medians = [f"**{np.median(p):.2f}x**" if p else "n/a" for p in pairs]
    print(f"| ratio, median of the {args.runs} pairs of runs | {medians[0]} | {medians[1]} |")
    if args.interleaved:
        print(interleaved(yaml, args.imgsz, batch, args.interleaved))
        if args.warm:
            print(interleaved(yaml, args.imgsz, batch, args.interleaved, warm=True))
    return 0


def ratio(a: float, b: float) -> str:
    """``a / b`` as a table's ratio; n/a where ``b`` is 0 (CPU time is read in the clock's ticks, 10 ms here: a
    tiny run can take none)."""
    return f"{a / b:.2f}x" if b else "n/a"


def interleaved(yaml, imgsz: int, batch: int, passes: int, warm: bool = False) -> str:
    """Both forms' items and collate in this process, batch by batch alternating (the order swapped every
    batch), over ``passes`` passes after one that warms the files: the ratio per pass and overall. Each pass
    on fresh datasets, or with ``warm`` the epochs after the first of the same two."""
    import time

    import cv2
    import torch

    from yolokit.data import DetectionDataset
    from yolokit.data.loader import collate_uint8

    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    ratios, total = [], {True: 0.0, False: 0.0}
    sets = {}
    for p in range(passes + 1):
        if not (warm and sets):
            sets = {m: DetectionDataset(yaml, "train", imgsz=imgsz, augment=True, segments=m) for m in (True, False)}
        for dataset in sets.values():
            dataset.set_epoch(p)
        n = len(sets[True]) // batch * batch
        spent = {True: 0.0, False: 0.0}
        for k, start in enumerate(range(0, n, batch)):
            for masks in ((True, False) if k % 2 else (False, True)):
                t = time.process_time()
                collate_uint8([sets[masks][i] for i in range(start, start + batch)])
                spent[masks] += time.process_time() - t
        if p:
            ratios.append(spent[True] / spent[False])
            total = {m: total[m] + spent[m] / n * 1000 / passes for m in total}
    plural = "es" if passes != 1 else ""
    form = f"epochs 2-{passes + 1} of one dataset each" if warm else f"{passes} pass{plural}, each a first epoch"
    return (f"| in one process, batches alternating, {form} | with masks {total[True]:.2f} ms/image | boxes "
            f"only {total[False]:.2f} ms/image | ratio per pass {min(ratios):.2f}-{max(ratios):.2f}x, median "
            f"**{np.median(ratios):.2f}x** |")


if __name__ == "__main__":
    sys.exit(main())
