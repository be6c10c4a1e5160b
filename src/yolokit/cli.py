"""The ``yolokit`` command: ``train``, ``val``, ``predict``, ``export``, ``demo`` and ``bench``.

Each subcommand is a function ``run_<name>(args)``; ``main`` only parses and dispatches.
``train`` flags are the ``TrainConfig`` field names.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import cv2
import numpy as np
import torch

import yolokit
from yolokit.data import DetectionDataset, build_dataloader
from yolokit.interop import export_onnx, load
from yolokit.ops.images import load_images
from yolokit.train import train, validate
from yolokit.train.config import add_config_flags, config_from_args
from yolokit.train.weights import class_names
from yolokit.viz import draw_detections

# `yolokit train` on the built-in shapes set: fields not given on the command line take
# these values, so the default run finishes in minutes on a laptop CPU.
SHAPES_PRESET = {"epochs": 25, "imgsz": 256, "batch": 16, "nbs": 16, "warmup_epochs": 1.0, "close_mosaic": 5}


def _model_from(args: argparse.Namespace) -> torch.nn.Module:
    """The model a command names: ``--weights`` (any format yolokit reads) or a fresh ``--model``."""
    if getattr(args, "weights", None):
        return load(args.weights, model=args.model if args.model and args.weights.endswith(".weights") else None)
    return yolokit.create_model(args.model, num_classes=args.num_classes)


def _write_results(images: Sequence[np.ndarray], names: Sequence[str], detections: list, out: Path,
                   class_list: Sequence[str] | None = None) -> None:
    """Drawn images plus ``detections.json`` (boxes xyxy in original pixels) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for image, name, det in zip(images, names, detections):
        drawn = draw_detections(image, det, class_list)
        cv2.imwrite(str(out / f"{Path(name).stem}.jpg"), drawn[..., ::-1])
        d = det.numpy()
        records.append({"image": name, "detections": [
            {"box": [round(float(v), 2) for v in b], "score": round(float(s), 4), "label": int(c),
             **({"name": class_list[int(c)]} if class_list and int(c) < len(class_list) else {})}
            for b, s, c in zip(d.boxes, d.scores, d.labels)]})
    (out / "detections.json").write_text(json.dumps(records, indent=1))


def run_train(args: argparse.Namespace) -> int:
    """Trains as the flags (and an optional --config YAML) say; prints the final metrics."""
    config = config_from_args(args)
    given = {k for k, v in vars(args).items() if v is not None}
    if config.data == "shapes" and not config.resume and not args.config:
        config = config.replace(**{k: v for k, v in SHAPES_PRESET.items() if k not in given})
    metrics = train(config)
    if int(os.environ.get("RANK", "0") or 0) == 0:   # under torchrun, every rank returns the metrics
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in metrics.items()}))
    return 0


def run_val(args: argparse.Namespace) -> int:
    """COCO mAP of a model on a dataset split, with per-class AP."""
    model = _model_from(args).eval().fuse()
    dataset = DetectionDataset(args.data, args.split, imgsz=args.imgsz, rect=True, stride=max(model.strides))
    if len(dataset.names) != model.num_classes:
        raise ValueError(f"{args.data} has {len(dataset.names)} classes but the model has {model.num_classes}")
    loader = build_dataloader(dataset, args.batch, workers=args.workers, shuffle=False)
    result, _ = validate(model, loader, num_classes=model.num_classes, conf=args.conf, iou=args.iou,
                         max_det=args.max_det)
    names = list(dataset.names.values()) if isinstance(dataset.names, dict) else list(dataset.names)
    print(f"{len(dataset)} images: P {result.precision:.3f}  R {result.recall:.3f}  "
          f"mAP50 {result.map50:.3f}  mAP50-95 {result.map50_95:.3f}")
    for name, ap in zip(names, result.per_class_ap):
        print(f"  {name:>20s}  AP50-95 {'-' if np.isnan(ap) else f'{ap:.3f}'}")
    return 0


def run_predict(args: argparse.Namespace) -> int:
    """Predicts on files or folders and writes drawn images plus ``detections.json``."""
    model = _model_from(args).eval().fuse()
    images, names = load_images(args.source)
    detections = model.predict(images, conf=args.conf, iou=args.iou, max_det=args.max_det, imgsz=args.imgsz)
    arrays = [im.permute(1, 2, 0).numpy() for im in images]
    _write_results(arrays, names, detections, Path(args.out), class_names(args.weights) if args.weights else None)
    for name, det in zip(names, detections):
        print(f"{name}: {len(det)} detections")
    print(f"results written to {args.out}")
    return 0


def run_export(args: argparse.Namespace) -> int:
    """Writes the model as ONNX (decode included, NMS optional)."""
    model = _model_from(args).eval()
    out = Path(args.out or f"{model.name}.onnx")
    export_onnx(model, out, imgsz=args.imgsz, nms=args.nms, conf=args.conf, iou=args.iou, max_det=args.max_det)
    print(f"exported {model.name} to {out}")
    return 0


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


def run_bench(args: argparse.Namespace) -> int:
    """Times yolokit against Ultralytics (when importable), case by case; see ``yolokit.bench``."""
    from yolokit.bench import run_from_args

    return run_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="yolokit", description="YOLOv3 / YOLOv8 object detection.")
    parser.add_argument("--version", action="version", version=f"yolokit {yolokit.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def model_flags(p: argparse.ArgumentParser, conf: float, imgsz: int, weights: bool = True) -> None:
        p.add_argument("--model", default="yolov8n", choices=yolokit.list_models(), help="model variant")
        if weights:
            p.add_argument("--weights", help="weights file (yolokit, Ultralytics .pt, Darknet .weights with --model)")
        p.add_argument("--num-classes", type=int, default=80, help="classes of a fresh model (without --weights)")
        p.add_argument("--imgsz", type=int, default=imgsz, help="image size in pixels")
        p.add_argument("--conf", type=float, default=conf, help="score threshold")
        p.add_argument("--iou", type=float, default=0.7, help="NMS IoU threshold")
        p.add_argument("--max-det", type=int, default=300, help="most detections per image")

    tr = sub.add_parser("train", help="train a model (default: yolov8n on the built-in shapes set)",
                        description=f"Flags are TrainConfig fields. On the shapes set, unset fields default to "
                                    f"{SHAPES_PRESET}.")
    add_config_flags(tr)
    tr.set_defaults(func=run_train)

    val = sub.add_parser("val", help="COCO mAP of a model on a dataset")
    model_flags(val, conf=0.001, imgsz=640)
    val.add_argument("--data", default="shapes", help="data.yaml, COCO json, or 'shapes'")
    val.add_argument("--split", default="val", help="train, val or test")
    val.add_argument("--batch", type=int, default=16)
    val.add_argument("--workers", type=int, default=2)
    val.set_defaults(func=run_val)

    predict = sub.add_parser("predict", help="detect objects in images or folders")
    predict.add_argument("source", nargs="+", help="image files or folders")
    model_flags(predict, conf=0.25, imgsz=640)
    predict.add_argument("--out", default="runs/predict", help="output folder")
    predict.set_defaults(func=run_predict)

    export = sub.add_parser("export", help="export to ONNX")
    model_flags(export, conf=0.25, imgsz=640)
    export.add_argument("--nms", action="store_true", help="append NMS to the graph")
    export.add_argument("--out", help="output .onnx path (default: <model>.onnx)")
    export.set_defaults(func=run_export)

    demo = sub.add_parser("demo", help="run an untrained model on generated images and print what it finds")
    model_flags(demo, conf=0.0, imgsz=320, weights=False)
    demo.set_defaults(max_det=5)
    demo.add_argument("--images", type=int, default=4, help="how many images to generate")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", default="runs/demo", help="output folder")
    demo.set_defaults(func=run_demo)

    from yolokit.bench import build_parser as bench_flags

    bench = sub.add_parser("bench", help="time yolokit against Ultralytics (when installed), case by case",
                           description="Each case times yolokit and the reference in turns and prints medians "
                                       "and the ratio yolokit / reference. Install the reference with "
                                       "pip install 'yolokit[bench]' in a separate environment.")
    bench_flags(bench)
    bench.set_defaults(func=run_bench)
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
