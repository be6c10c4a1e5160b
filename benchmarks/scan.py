"""The first scan of a YOLO folder (labels read, image headers checked, no pixels decoded), and a
re-scan from the label cache: yolokit vs Ultralytics, side by side in one process.

    python benchmarks/scan.py --images 5000                       # yolokit only
    /path/to/venv-with-ultralytics/bin/python benchmarks/scan.py --images 5000 --ultralytics

The folder (640x480 JPEGs with a few boxes each, photo-like in size and decode cost: gradients,
rectangles and grain, about 100 KB) is generated once under --root. Each round times both sides in turns (A B A B ...),
after one warm-up round, so the files are in the page cache for both; medians are printed.
yolokit: ``yolo_index(cache=False)`` (first scan) and ``yolo_index()`` (re-scan, cache present).
Ultralytics: ``YOLODataset.cache_labels`` (their scan, a thread pool) and ``get_labels`` with
the cache present.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np


def make_folder(root: Path, n: int) -> Path:
    yaml = root / "data.yaml"
    if yaml.is_file() and len(list((root / "images" / "train").glob("*.jpg"))) == n:
        return yaml
    from harness.pipeline import photo_like

    rng = np.random.default_rng(0)
    (root / "images" / "train").mkdir(parents=True, exist_ok=True)
    (root / "labels" / "train").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        photo_like(rng, root / "images" / "train" / f"{i:06d}.jpg", root / "labels" / "train" / f"{i:06d}.txt",
                   boxes=(1, 6), classes=3, sizes=lambda: rng.uniform(0.05, 0.4, 2))
    yaml.write_text(f"path: {root}\ntrain: images/train\nval: images/train\nnames: [a, b, c]\n")
    return yaml


def yolokit_sides(yaml: Path):
    from yolokit.data.sources.readers import yolo_index

    def first() -> int:
        return len(yolo_index(yaml, "train", cache=False))

    def again() -> int:
        return len(yolo_index(yaml, "train", cache=True))

    again()                                       # writes the cache the re-scan reads
    return first, again


def reference_sides(yaml: Path):
    from ultralytics.data.dataset import YOLODataset
    from ultralytics.data.utils import check_det_dataset

    data = check_det_dataset(str(yaml))
    dataset = YOLODataset(img_path=data["train"], imgsz=640, augment=False, data=data, task="detect")
    scratch = yaml.parent / "scratch.cache"

    def first() -> int:
        return len(dataset.cache_labels(scratch)["labels"])

    def again() -> int:
        return len(dataset.get_labels())

    return first, again


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=5000)
    p.add_argument("--root", default="/tmp/yolokit-scan-v2")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ultralytics", action="store_true")
    args = p.parse_args()
    yaml = make_folder(Path(args.root) / str(args.images), args.images)
    sides = {"yolokit": yolokit_sides(yaml)}
    if args.ultralytics:
        sides["ultralytics"] = reference_sides(yaml)
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds + 1):
        for name, (first, again) in sides.items():
            for kind, fn in (("first scan", first), ("re-scan", again)):
                start = time.perf_counter()
                n = fn()
                if r:                                 # round 0 warms up
                    times.setdefault((name, kind), []).append(time.perf_counter() - start)
                assert n == args.images, (name, kind, n)
    print(f"{args.images} images, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    for (name, kind), values in times.items():
        print(f"{name:12s} {kind:10s} median {statistics.median(values):.3f} s  "
              f"runs {' '.join(f'{v:.3f}' for v in values)}")


if __name__ == "__main__":
    main()
