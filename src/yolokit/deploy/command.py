"""``yolokit export`` and ``yolokit benchmark``: their flags and what they run (``yolokit.cli`` adds them)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from yolokit.deploy.bench import ROWS, benchmark, format_table
from yolokit.deploy.exporter import FORMATS, export
from yolokit.deploy.runtime import format_of
from yolokit.interop import load
from yolokit.models import Detector, create_model


def add_commands(sub: argparse._SubParsersAction, model_flags: Callable[..., None]) -> None:
    """Adds ``export`` and ``benchmark`` to the ``yolokit`` parser's subcommands."""
    ex = sub.add_parser("export", help="export to ONNX, OpenVINO or a compiled .pt2, checked against the model",
                        description="Writes the model (network, decode and optionally NMS) in --format, runs the "
                                    "file once on a sample batch and compares it with the model: the largest "
                                    "difference is printed, and past the format's tolerance the export fails. "
                                    "The file then runs where a weights file runs: yolokit predict and val "
                                    "--weights FILE, yolokit.load(FILE).")
    model_flags(ex, conf=0.25, imgsz=640, end_to_end=False)
    ex.add_argument("--format", default="onnx", choices=list(FORMATS),
                    help="onnx (onnxruntime), openvino (a folder), pt2 (AOTInductor: torch only where it runs)")
    ex.add_argument("--half", action="store_true", help="float16 (OpenVINO: float16 weights)")
    ex.add_argument("--int8", action="store_true", help="OpenVINO: int8 after training (NNCF), calibrated on --data")
    ex.add_argument("--data", help="--int8's calibration images: data.yaml, COCO json or 'shapes' (train split)")
    ex.add_argument("--static", action="store_true", help="only --imgsz (default: any multiple of the stride)")
    ex.add_argument("--nms", action="store_true", help="NMS in the graph (pt2: torchvision where it runs)")
    ex.add_argument("--end-to-end", action=argparse.BooleanOptionalAction, default=None,
                    help="yolo26: the one-to-one branch and its top-k, no NMS (the default without --nms)")
    ex.add_argument("--no-check", dest="check", action="store_false", help="skip running the file once")
    ex.add_argument("--out", help="output path (default: <model>.onnx, <model>_openvino, <model>.pt2)")
    ex.set_defaults(func=run_export)

    bench = sub.add_parser("benchmark", help="every export format side by side: size, export time, mAP, speed",
                           description="Exports the weights to each format, validates each file on --data's val "
                                       "split (the protocol of yolokit val) and times its forward pass at batch 1 "
                                       "(median latency) and at --batch (images/s) at --imgsz on the CPU.")
    model_flags(bench, conf=0.001, imgsz=640, end_to_end=False)
    bench.add_argument("--data", default="shapes", help="data.yaml, COCO json, or 'shapes' (its val split)")
    bench.add_argument("--formats", default=",".join(ROWS),
                       help=f"comma-separated rows (default all: {', '.join(ROWS)})")
    bench.add_argument("--batch", type=int, default=16, help="the batch of the images/s column and of validation")
    bench.add_argument("--val-imgsz", type=int, help="the validation size (default --imgsz)")
    bench.add_argument("--repeats", type=int, default=10, help="timed forward passes (the median is kept)")
    bench.add_argument("--out", help="keep the exported files in this folder (default: a temporary one)")
    bench.set_defaults(func=run_benchmark)


def _model(args: argparse.Namespace) -> Detector:
    if getattr(args, "weights", None) and format_of(args.weights) is not None:
        raise ValueError(f"{args.weights} is already an exported file: pass the weights it came from (best.pt)")
    if args.weights:
        return load(args.weights, model=args.model)
    return create_model(args.model or "yolov8n", num_classes=args.num_classes)


def run_export(args: argparse.Namespace) -> int:
    """Writes the model in --format, checks the file against it, and says both."""
    model = _model(args).eval()
    export(model, args.format, Path(args.out) if args.out else None, imgsz=args.imgsz, half=args.half,
           int8=args.int8, data=args.data, dynamic=not args.static, nms=args.nms, end_to_end=args.end_to_end,
           conf=args.conf, iou=args.iou, max_det=args.max_det,
           device="cuda" if args.format == "pt2" and str(args.device).startswith("cuda") else "cpu",
           check=args.check)
    return 0


def run_benchmark(args: argparse.Namespace) -> int:
    """The table of every format (``deploy.bench``), printed as each row is measured and at the end."""
    model = _model(args)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    print(f"{model.name} at {args.imgsz} px on the CPU; mAP50-95 on {args.data} (val)")
    rows = benchmark(model, data=args.data, imgsz=args.imgsz, formats=formats, out=args.out, batch=args.batch,
                     repeats=args.repeats, val_imgsz=args.val_imgsz, report=None)
    print(format_table(rows))
    return 0
