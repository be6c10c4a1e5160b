"""Draws the site's pictures from real runs and measurements (none is drawn by hand), into docs/images/:

- ``curves.png``: mAP50 and mAP50-95 per epoch of the demo's preset, every seed of both trainers
  (``benchmarks/parity.py``'s runs: yolokit and the reference with the same settings);
- ``levers.png``: the speed guide's measured figures as bar charts (each figure is quoted from
  BENCHMARKS.md, and tests/test_docs.py checks that the quote is still there);
- ``augment.png``: one training batch of the shapes set on both augmentation paths (the loader's
  workers, and the device pass), the targets drawn on each image;
- ``predictions.png``: the demo's trained model's detections on validation images.

    yolokit train --out runs/demo                   # the demo (25 epochs at 256 px on a CPU: minutes)
    python benchmarks/parity.py --out runs/parity   # both trainers, seeds 0-4 (the bench environment)
    python docs/figures.py --run runs/demo --parity runs/parity

``--run`` draws ``predictions.png``, ``--parity`` ``curves.png``; ``levers.png`` and ``augment.png``
always. mkdocs does not publish this file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

DOCS = Path(__file__).resolve().parent
IMAGES = DOCS / "images"

# (chart, bar, value, unit, the BENCHMARKS.md text the value is read from)
LEVERS = [
    ("channels_last, H200 bf16 training (x faster)", "yolov8n", 2.54, "x", "1,709/672 (2.54x)"),
    ("channels_last, H200 bf16 training (x faster)", "yolov8s", 2.09, "x", "1,155/552 (2.09x)"),
    ("channels_last, H200 bf16 training (x faster)", "yolov8l", 1.74, "x", "432/248 (1.74x)"),
    ("channels_last, H200 bf16 training (x faster)", "yolov3", 2.02, "x", "399/198 (2.02x)"),
    ("precision, yolov8s 640 b64 on an H200 (img/s)", "fp32", 282, "", "282 / 539 / 551 img/s"),
    ("precision, yolov8s 640 b64 on an H200 (img/s)", "fp32 TF32", 539, "", "282 / 539 / 551 img/s"),
    ("precision, yolov8s 640 b64 on an H200 (img/s)", "bf16", 551, "", "282 / 539 / 551 img/s"),
    ("the loader's CPU per image at 640 (ms)", "reference", 7.97, "", "| 247.5 | 7.97 |"),
    ("the loader's CPU per image at 640 (ms)", "workers", 7.62, "", "| 250.3 | 7.62 |"),
    ("the loader's CPU per image at 640 (ms)", "HSV on device", 4.14, "", "| 440.9 | 4.14 |"),
    ("the loader's CPU per image at 640 (ms)", "device pass", 0.98, "", "| 1531.7 | 0.98 |"),
    ("checkpointing, b32, H100: memory saved (%)", "yolov8l", 62.6, "%", "62.6%, 1.30x"),
    ("checkpointing, b32, H100: memory saved (%)", "yolov3", 55.3, "%", "55.3%, 1.24x"),
]


def curves(parity: Path, out: Path) -> Path:
    """mAP50 and mAP50-95 per epoch of every run of a ``benchmarks/parity.py`` folder (its runs.json): each seed of
    both trainers thin, each side's mean bold (``parity.plot``)."""
    import json
    import sys

    sys.path.insert(0, str(DOCS.parent / "benchmarks"))
    from parity import plot

    runs = json.loads((parity / "runs.json").read_text())
    return plot(runs, out / "curves.png", "shapes demo (yolov8n, 256 px, CPU)")


def levers(out: Path) -> Path:
    import matplotlib.pyplot as plt

    charts = list(dict.fromkeys(chart for chart, *_ in LEVERS))
    fig, axes = plt.subplots(1, len(charts), figsize=(4 * len(charts), 3.4), constrained_layout=True)
    for ax, chart in zip(axes, charts, strict=True):
        bars = [(bar, value, unit) for c, bar, value, unit, _ in LEVERS if c == chart]
        ax.bar(range(len(bars)), [v for _, v, _ in bars], color="#3b7dd8")
        ax.set_xticks(range(len(bars)), [b for b, _, _ in bars], rotation=20, ha="right", fontsize=8)
        for i, (_, value, unit) in enumerate(bars):
            ax.annotate(f"{value:g}{unit}", (i, value), ha="center", va="bottom", fontsize=8)
        ax.set_title(chart, fontsize=9)
        ax.margins(y=0.15)
    path = out / "levers.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _grid(images: list[np.ndarray], columns: int) -> np.ndarray:
    h, w = images[0].shape[:2]
    rows = -(-len(images) // columns)
    canvas = np.full((rows * h + (rows - 1) * 4, columns * w + (columns - 1) * 4, 3), 255, np.uint8)
    for i, image in enumerate(images):
        r, c = divmod(i, columns)
        canvas[r * (h + 4):r * (h + 4) + h, c * (w + 4):c * (w + 4) + w] = image
    return canvas


def _drawn(batch: dict, names) -> list[np.ndarray]:
    import torch

    from yolokit.ops import Detections
    from yolokit.viz import draw_detections

    images = (batch["images"] * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    targets = batch["targets"]
    out = []
    for i, image in enumerate(images):
        rows = targets[targets[:, 0] == i]
        det = Detections(rows[:, 2:6], torch.ones(len(rows)), rows[:, 1].long())
        out.append(draw_detections(np.ascontiguousarray(image), det, names, thickness=1, show_scores=False))
    return out


def augment(out: Path, data: str = "shapes", imgsz: int = 192, n: int = 8) -> Path:
    """One batch of the same images and random draws on the workers path and on the device pass."""
    import cv2

    from yolokit.data import DetectionDataset, build_dataloader, to_device

    rows = []
    for path in ("workers", "device"):
        dataset = DetectionDataset(data, "train", imgsz=imgsz, augment=True)
        loader = build_dataloader(dataset, n, workers=0, seed=0, uint8_images=True, augment_on=path)
        loader.set_epoch(0)
        batch = to_device(next(iter(loader)), "cpu")
        grid = _grid(_drawn(batch, dataset.names), n)
        label = np.full((28, grid.shape[1], 3), 255, np.uint8)
        cv2.putText(label, f"augment_on={path!r}", (4, 20), cv2.FONT_HERSHEY_SIMPLEX, 0.6, (0, 0, 0), 1, cv2.LINE_AA)
        rows += [label, grid]
    image = np.concatenate(rows)
    path = out / "augment.png"
    cv2.imwrite(str(path), cv2.cvtColor(image, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_PNG_COMPRESSION, 9])
    return path


def predictions(run: Path, out: Path, n: int = 4) -> Path:
    import cv2
    import yaml

    import yolokit
    from yolokit.predict import predict

    model = yolokit.load(run / "weights" / "best.pt").fuse()
    config = yaml.safe_load((run / "config.yaml").read_text())
    from yolokit.data import DetectionDataset

    index = DetectionDataset(config["data"], "val", imgsz=config["imgsz"]).index
    files = [p for p, labels in zip(index.paths, index.labels, strict=True) if len(labels) >= 2][:n]   # objects
    drawn = [r.plot() for r in predict(model, [str(f) for f in files], imgsz=config["imgsz"], conf=0.25)]
    size = max(d.shape[0] for d in drawn), max(d.shape[1] for d in drawn)
    drawn = [cv2.resize(d, (size[1], size[0])) for d in drawn]
    path = out / "predictions.png"
    cv2.imwrite(str(path), cv2.cvtColor(_grid(drawn, n), cv2.COLOR_RGB2BGR))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, help="the demo's run folder (yolokit train)")
    parser.add_argument("--parity", type=Path, help="a benchmarks/parity.py folder of the demo's preset")
    parser.add_argument("--data", default="shapes", help="the set of the augmentation picture")
    parser.add_argument("--out", type=Path, default=IMAGES)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    made = [levers(args.out), augment(args.out, args.data)]
    if args.run is not None:
        made.append(predictions(args.run, args.out))
    if args.parity is not None:
        made.append(curves(args.parity, args.out))
    for path in made:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
