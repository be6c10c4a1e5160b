"""The ``yolokit`` command: ``demo`` and ``predict``.

Each subcommand is a function ``run_<name>(args)``; ``main`` only parses and dispatches.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import cv2
import numpy as np
import torch

import yolokit
from yolokit.ops.images import load_images
from yolokit.viz import draw_detections


def _demo_images(n: int, size: int, seed: int) -> list[np.ndarray]:
    """``n`` RGB images of random filled circles and rectangles on a noisy background."""
    rng = np.random.default_rng(seed)
    images = []
    for _ in range(n):
        image = rng.integers(90, 160, (size, size, 3), dtype=np.uint8)
        for _ in range(int(rng.integers(1, 5))):
            colour = tuple(int(c) for c in rng.integers(0, 256, 3))
            x, y = (int(v) for v in rng.integers(size // 8, size - size // 8, 2))
            r = int(rng.integers(size // 16, size // 5))
            if rng.random() < 0.5:
                cv2.circle(image, (x, y), r, colour, -1)
            else:
                cv2.rectangle(image, (x - r, y - r), (x + r, y + r), colour, -1)
        images.append(image)
    return images


def _write_results(images: Sequence[np.ndarray], names: Sequence[str], detections: list, out: Path,
                   class_names: Sequence[str] | None = None) -> None:
    """Drawn images plus ``detections.json`` (boxes xyxy in original pixels) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for i, (image, name, det) in enumerate(zip(images, names, detections)):
        drawn = draw_detections(image, det, class_names)
        stem = Path(name).stem
        cv2.imwrite(str(out / f"{stem}.jpg"), drawn[..., ::-1])
        d = det.numpy()
        records.append({"image": name, "detections": [
            {"box": [round(float(v), 2) for v in b], "score": round(float(s), 4), "label": int(c)}
            for b, s, c in zip(d.boxes, d.scores, d.labels)]})
    (out / "detections.json").write_text(json.dumps(records, indent=1))


def run_demo(args: argparse.Namespace) -> int:
    """Builds a model, runs it on generated images, prints detections and the model summary."""
    torch.manual_seed(args.seed)
    model = yolokit.create_model(args.model, num_classes=args.num_classes).eval()
    images = _demo_images(args.images, args.imgsz, args.seed)
    detections = model.predict(images, conf=args.conf, iou=args.iou, max_det=args.max_det, imgsz=args.imgsz)
    print(f"{args.model}: untrained weights, so these are the highest-scoring boxes of a random network")
    for i, det in enumerate(detections):
        print(f"image {i}: {det}")
    print(model.summary(args.imgsz))
    _write_results(images, [f"demo{i}" for i in range(len(images))], detections, Path(args.out))
    print(f"drawn images and detections.json written to {args.out}")
    return 0


def run_predict(args: argparse.Namespace) -> int:
    """Predicts on files or folders and writes drawn images plus ``detections.json``."""
    model = yolokit.create_model(args.model, num_classes=args.num_classes).eval()
    images, names = load_images(args.source)
    detections = model.predict(images, conf=args.conf, iou=args.iou, max_det=args.max_det, imgsz=args.imgsz)
    arrays = [im.permute(1, 2, 0).numpy() for im in images]
    _write_results(arrays, names, detections, Path(args.out))
    for name, det in zip(names, detections):
        print(f"{name}: {len(det)} detections")
    print(f"results written to {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="yolokit", description="YOLOv3 / YOLOv8 object detection.")
    parser.add_argument("--version", action="version", version=f"yolokit {yolokit.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser, conf: float, imgsz: int) -> None:
        p.add_argument("--model", default="yolov8n", choices=yolokit.list_models(), help="model variant")
        p.add_argument("--num-classes", type=int, default=80, help="number of classes")
        p.add_argument("--imgsz", type=int, default=imgsz, help="inference size in pixels")
        p.add_argument("--conf", type=float, default=conf, help="score threshold")
        p.add_argument("--iou", type=float, default=0.7, help="NMS IoU threshold")
        p.add_argument("--max-det", type=int, default=300, help="most detections per image")

    demo = sub.add_parser("demo", help="run a model on generated images and print what it finds")
    common(demo, conf=0.0, imgsz=320)
    demo.set_defaults(max_det=5)
    demo.add_argument("--images", type=int, default=4, help="how many images to generate")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", default="runs/demo", help="output folder")
    demo.set_defaults(func=run_demo)

    predict = sub.add_parser("predict", help="detect objects in images or folders")
    predict.add_argument("source", nargs="+", help="image files or folders")
    common(predict, conf=0.25, imgsz=640)
    predict.add_argument("--out", default="runs/predict", help="output folder")
    predict.set_defaults(func=run_predict)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"yolokit {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
