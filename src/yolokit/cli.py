"""The ``yolokit`` command: ``train``, ``tune``, ``val``, ``predict``, ``compare``, ``export``, ``benchmark``,
``data`` and ``demo`` (``export`` and ``benchmark``: ``yolokit.deploy.command``).

Each subcommand is a function ``run_<name>(args)``; ``main`` only parses and dispatches.
``train`` flags are the ``TrainConfig`` field names.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

import yolokit
from yolokit.accel import distributed
from yolokit.accel.devices import DeviceFailure, resolve_device
from yolokit.accel.launcher import LaunchError
from yolokit.accel.stop import GracefulStop, Interrupted
from yolokit.data import DetectionDataset, build_dataloader
from yolokit.data.sources.shapes import draw_shapes_image
from yolokit.data.store.remote import CredentialsError, StoreError, one_line
from yolokit.deploy import ExportedModel, load
from yolokit.deploy.command import add_commands as add_deploy_commands
from yolokit.models import Detector
from yolokit.predict import ResultWriter, next_run_dir, predict_iter
from yolokit.train import compare_runs, train
from yolokit.train.config import AUGMENT_FIELDS, TrainConfig, add_config_flags, config_from_args
from yolokit.train.files import SaveError
from yolokit.train.plots import validation_plots
from yolokit.train.trackers.base import TrackerError
from yolokit.val import validate
from yolokit.val.loop import model_device

# `yolokit train` on a built-in set: unset fields take these values, so the default run takes minutes on a CPU;
# shapes-seg: fewer epochs at a smaller size (a seg step costs 1.3 detection steps, and validation a mask per box)
SHAPES_PRESET = {"epochs": 25, "imgsz": 256, "batch": 16, "nbs": 16, "warmup_epochs": 1.0, "close_mosaic": 5}
PRESETS = {"shapes": SHAPES_PRESET, "shapes-seg": {**SHAPES_PRESET, "epochs": 20, "imgsz": 192}}


def _model_from(args: argparse.Namespace) -> Detector:
    """The model a command names: ``--weights`` (any format yolokit reads; ``--model`` checks or
    picks the variant) or a fresh ``--model``."""
    if getattr(args, "weights", None):   # an exported file runs on the CPU unless --device cuda names the GPU
        device = args.device if str(getattr(args, "device", "cpu")).startswith("cuda") else "cpu"
        return load(args.weights, model=args.model, device=device)
    return yolokit.create_model(args.model or "yolov8n", num_classes=args.num_classes)


def _inference_model(args: argparse.Namespace) -> Detector:
    """The named model on ``--device``, eval mode, batch norms fused, float16 with ``--half``."""
    device = resolve_device(args.device)
    half = getattr(args, "half", False)
    if half and device.type != "cuda":
        raise ValueError(f"--half needs a CUDA device (got {device}); float16 convolutions on the CPU are slow")
    model = _model_from(args)
    if isinstance(model, ExportedModel):            # runs in its own runtime, at its own precision
        if half:
            raise ValueError(f"{args.weights}: an exported file keeps its precision; export it with --half instead")
        if model.info["output"] != "detections":    # NMS in the graph: the file's own detections
            model.check_nms(getattr(args, "nms", True))
        return model
    model = model.to(device).eval().fuse()
    model.check_nms(getattr(args, "nms", True))   # --no-nms on a model without a one-to-one branch: one line
    return model.half() if half else model


def run_train(args: argparse.Namespace) -> int:
    """Trains as the flags (and an optional --config YAML) say; prints the final metrics."""
    config = config_from_args(args)
    given = {k for k, v in vars(args).items() if v is not None}
    if config.data in PRESETS and config.resume in (None, "auto") and not args.config:  # auto may start fresh
        config = config.replace(**{k: v for k, v in PRESETS[config.data].items() if k not in given})
    metrics = train(config)
    if int(os.environ.get("RANK", "0") or 0) == 0:   # under torchrun, every rank returns the metrics
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in metrics.items()}))
    return 0


def run_tune(args: argparse.Namespace) -> int:
    """A hyperparameter study (``yolokit.tune``): the flags set the base config, ``--space`` what varies."""
    from yolokit.train.sweeps.tuning import tune

    fields = [f.name for f in dataclasses.fields(TrainConfig) if f.name not in ("augment", "out")]
    names = fields + sorted(AUGMENT_FIELDS)
    given = {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}
    if args.config:
        given = {**TrainConfig.from_yaml(args.config).to_dict(), **given}
    config = given or None
    if args.space and not args.config and given.get("data", "shapes") in PRESETS:   # as `yolokit train` does
        config = {**PRESETS[given.get("data", "shapes")], **given}
    result = tune(args.space, config, trials=args.trials, parallel=args.parallel, storage=args.storage,
                  study=args.study, metric=args.metric, pruner=args.pruner, out=args.out or "runs/tune",
                  keep_weights=args.keep_weights)
    print(result)
    return 0


def run_val(args: argparse.Namespace) -> int:
    """COCO mAP of a model on a dataset split, by the usual protocol; per-class table, CSV and charts."""
    model = _inference_model(args)
    rect = getattr(model, "fixed_imgsz", None) is None   # a file exported for one size takes squares of it
    dataset = DetectionDataset(args.data, args.split, imgsz=args.imgsz, rect=rect, stride=max(model.strides))
    names = list(dataset.names.values()) if isinstance(dataset.names, dict) else list(dataset.names)
    if len(names) != model.num_classes:
        raise ValueError(f"{args.data} has {len(names)} classes but the model has {model.num_classes}")
    if model.has_names and model.names != names:
        print(f"note: the weights name their classes {model.names[:5]}..., the data {names[:5]}...; "
              "the table uses the data's names")
    loader = build_dataloader(dataset, args.batch, workers=args.workers, shuffle=False)
    out = Path(args.out) if args.out else next_run_dir(Path("runs") / "val")
    saving = args.save_json or args.save_txt
    writer = ResultWriter(out, save=False, save_txt=args.save_txt, save_conf=args.save_conf,
                          save_json=args.save_json, category_ids=dataset.category_ids) if saving else None
    started = time.perf_counter()
    with writer or contextlib.nullcontext():   # closes predictions.json, also when stopped
        result, samples = validate(model, loader, num_classes=model.num_classes, conf=args.conf, iou=args.iou,
                                   max_det=args.max_det, multi_label=not args.single_label, progress=True,
                                   nms=args.nms,
                                   keep_samples=8 if args.plots else 0,
                                   on_image=writer.validation_sink(names, dataset.image_ids) if writer else None)
    seconds = time.perf_counter() - started
    print(result.format_table(names))
    selection = (f"NMS {'single' if args.single_label else 'multi'}-label, conf {args.conf:g}, iou {args.iou:g}"
                 if args.nms else f"one-to-one top-{args.max_det}, no NMS, conf {args.conf:g}")
    print(f"{len(dataset)} images in {seconds:.1f} s on {model_device(model)}"
          f"{' (float16)' if args.half else ''}; {selection}, max_det {args.max_det}; mAP is COCO's (101-point)")
    result.write_csv(out / "per_class.csv", names)
    if args.plots:
        validation_plots(result, samples, names, out)
    print(f"per-class table{' and charts' if args.plots else ''} written to {out}")
    if args.save_json:
        print(f"COCO results written to {out / 'predictions.json'}")
    if args.save_txt:
        print(f"YOLO label files{' with scores' if args.save_conf else ''} written to {out / 'labels'}")
    return 0


def run_predict(args: argparse.Namespace) -> int:
    """Predicts on images, folders, globs, lists, videos or streams; saves into a run folder as it goes."""
    model = _inference_model(args)
    source = args.source if len(args.source) > 1 else args.source[0]
    out = Path(args.out) if args.out else next_run_dir(Path("runs") / "predict")
    count, started = 0, time.perf_counter()
    try:
        with ResultWriter(out, save=args.save, save_txt=args.save_txt, save_conf=args.save_conf,
                          save_json=args.save_json, save_crop=args.save_crop) as writer:   # closes files and videos
            for result in predict_iter(model, source, imgsz=args.imgsz, conf=args.conf, iou=args.iou,
                                       max_det=args.max_det, batch=args.batch, classes=args.classes,
                                       agnostic=args.agnostic, vid_stride=args.vid_stride, nms=args.nms):
                writer.write(result)
                count += 1
                where = result.path if result.frame is None else f"{result.path} frame {result.frame}"
                h, w = result.orig_shape
                print(f"{where}: {w}x{h} {result.summary()}")
    except KeyboardInterrupt as exc:
        stop = Interrupted.of(exc)
        print(f"stopped by {signal.Signals(stop.signum).name} after {count} images; their results are in {out}",
              file=sys.stderr)
        stop.reported = True
        raise stop from None
    seconds = time.perf_counter() - started
    print(f"{count} images in {seconds:.1f} s ({count / max(seconds, 1e-9):.1f}/s) on "
          f"{model_device(model)}; results written to {out}")
    return 0


def run_compare(args: argparse.Namespace) -> int:
    """Training runs side by side: best and last mAP, epochs, hours, and the config fields that differ."""
    print(compare_runs(args.runs))
    return 0


def _demo_images(n: int, size: int, seed: int) -> list[np.ndarray]:
    """``n`` RGB images of the built-in shapes set's kind (``yolokit.data.sources.shapes``), long side ``size``."""
    rng = np.random.default_rng(seed)
    return [np.ascontiguousarray(draw_shapes_image(rng, imgsz=size, background_fraction=0.0)[0][..., ::-1])
            for _ in range(n)]


def run_data_shard(args: argparse.Namespace) -> int:
    from yolokit.data.store.shards import write_shards

    splits = [s for s in args.splits.replace(" ", ",").split(",") if s] if args.splits else None
    summaries = write_shards(args.src, args.out, splits=splits, chunk_bytes=args.chunk_bytes,
                             image_dir=args.image_dir)
    for s in summaries.values():
        left = sum(p.action == "excluded" for p in s.problems)
        print(f"{s.split}: {s.images} images in {s.chunks} shards at {s.url} ({s.written} written now"
              f"{f', {left} left out: named above' if left else ''})")
    out = args.out.rstrip("/")
    print(f"train from them with: yolokit train --data {out}")
    return 0


def run_demo(args: argparse.Namespace) -> int:
    """Builds a model, runs it on generated images, prints detections and the model summary."""
    torch.manual_seed(args.seed)
    model = yolokit.create_model(args.model or "yolov8n", num_classes=args.num_classes).eval()
    images = _demo_images(args.images, args.imgsz, args.seed)
    print(f"{model.name}: untrained weights, so these are the highest-scoring boxes of a random network")
    with ResultWriter(args.out, save_json=True) as writer:
        for i, result in enumerate(predict_iter(model, images, conf=args.conf, iou=args.iou, max_det=args.max_det,
                                                imgsz=args.imgsz, batch=len(images))):
            print(f"image {i}: {result.detections}")
            writer.write(result)
    print(model.summary(args.imgsz))
    print(f"drawn images and predictions.json written to {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="yolokit", description="YOLOv3 / YOLOv8 object detection.")
    parser.add_argument("--version", action="version", version=f"yolokit {yolokit.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def model_flags(p: argparse.ArgumentParser, conf: float, imgsz: int, weights: bool = True,
                    end_to_end: bool = True) -> None:
        p.add_argument("--model", choices=yolokit.list_models(),
                       help="model variant (default yolov8n); with --weights, checks or picks the variant")
        if weights:
            p.add_argument("--weights", help="weights file (yolokit, Ultralytics .pt, Darknet .weights); predict and "
                                             "val also run an exported .onnx, OpenVINO folder or .pt2")
            p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
        p.add_argument("--num-classes", type=int, default=80, help="classes of a fresh model (without --weights)")
        p.add_argument("--imgsz", type=int, default=imgsz, help="image size in pixels")
        p.add_argument("--conf", type=float, default=conf, help="score threshold")
        p.add_argument("--iou", type=float, default=0.7, help="NMS IoU threshold")
        p.add_argument("--max-det", type=int, default=300, help="most detections per image")
        if end_to_end:
            p.add_argument("--nms", action=argparse.BooleanOptionalAction, default=True,
                           help="--no-nms: an end-to-end model's (yolo26) one-to-one detections, its --max-det "
                                "best without NMS")

    tr = sub.add_parser("train", help="train a model (default: yolov8n on the built-in shapes set)",
                        description=f"Flags are TrainConfig fields. Built-in sets' presets of unset fields: {PRESETS}")
    add_config_flags(tr)
    tr.set_defaults(func=run_train)

    tune = sub.add_parser("tune", help="hyperparameter search: a study of training runs (Optuna), parallel, resumable",
                          description="Each trial trains a run in <out>/trial_<n> (default out: runs/tune) from the "
                                      "base config (TrainConfig flags or --config) with the fields of --space "
                                      "sampled; a pruner stops trials whose per-epoch metric lags. Trials run "
                                      "--parallel at once here, and on other machines that run this command with "
                                      "the same --storage and --study. The same command again resumes a stopped "
                                      "study. Ends with trials.csv, best.yaml and the trials side by side.")
    tune.add_argument("--space", help="YAML of the search space (lr0: {low: 1.0e-4, high: 0.1, log: true}, "
                                      "model: {choices: [yolov8n, yolov8s]}, ...); a study made elsewhere has its own")
    tune.add_argument("--trials", type=int, default=10, help="finished trials the study should reach (default 10)")
    tune.add_argument("--parallel", type=int, default=1, help="trials trained at once on this machine, one process "
                                                              "each (default 1)")
    tune.add_argument("--storage", help="the study's storage: a journal file (default <out>/study.journal; on a "
                                        "shared filesystem for several machines) or a database URL "
                                        "(postgresql://..., mysql://..., sqlite:///...)")
    tune.add_argument("--study", help="the study's name (default: the name of --out)")
    tune.add_argument("--metric", help="what the study maximizes, per epoch for the pruner (default mAP50-95; "
                                       "mAP50, fitness, precision, recall; train/box, train/cls, train/dfl minimized)")
    tune.add_argument("--keep-weights", type=int, help="at the end only the best N finished trials keep their weights "
                      "files (default: all)")
    tune.add_argument("--pruner", choices=["median", "hyperband", "none"], help="stops lagging trials (default "
                                                                                "median)")
    add_config_flags(tune)
    tune.set_defaults(func=run_tune)

    val = sub.add_parser("val", help="COCO mAP of a model on a dataset (multi-label NMS, conf 0.001, iou 0.7)",
                         description="Validates by the usual protocol of the published YOLOv8 numbers: "
                                     "multi-label NMS, conf 0.001, iou 0.7, max_det 300, rectangular batches. "
                                     "Prints the per-class table and writes it (per_class.csv) with the charts "
                                     "into the run folder; --save-json and --save-txt also write the predictions.")
    model_flags(val, conf=0.001, imgsz=640)
    val.add_argument("--data", default="shapes", help="data.yaml, COCO json, or 'shapes'")
    val.add_argument("--split", default="val", help="train, val or test")
    val.add_argument("--batch", type=int, default=16)
    val.add_argument("--workers", type=int, default=2)
    val.add_argument("--half", action="store_true", help="float16 inference (CUDA only)")
    val.add_argument("--single-label", action="store_true", help="keep only each box's best class in NMS")
    val.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True,
                     help="PR / F1 curves, confusion matrix, labels vs predictions")
    val.add_argument("--save-json", action="store_true",
                     help="COCO results in predictions.json (a COCO json's image and category ids)")
    val.add_argument("--save-txt", action="store_true", help="YOLO label files under labels/")
    val.add_argument("--save-conf", action="store_true", help="scores in the label files")
    val.add_argument("--out", help="run folder (default: runs/val, runs/val2, ...)")
    val.set_defaults(func=run_val)

    predict = sub.add_parser("predict", help="detect objects in images, folders, videos or streams",
                             description="Sources: image or video files, folders (recursive), globs "
                                         "('imgs/**/*.jpg'), a .txt list of paths, a camera index, a stream URL. "
                                         "Outputs mirror the sources' relative paths inside the run folder.")
    predict.add_argument("source", nargs="+", help="files, folders, globs, .txt lists, videos, camera index, URL")
    model_flags(predict, conf=0.25, imgsz=640)
    predict.add_argument("--batch", type=int, default=1, help="images per forward pass")
    predict.add_argument("--half", action="store_true", help="float16 inference (CUDA only)")
    predict.add_argument("--classes", type=int, nargs="+", help="keep only these class indices")
    predict.add_argument("--agnostic", action="store_true", help="class-agnostic NMS")
    predict.add_argument("--vid-stride", type=int, default=1, help="keep every n-th video frame")
    predict.add_argument("--save", action=argparse.BooleanOptionalAction, default=True,
                         help="annotated images and videos (videos keep the source's frame rate)")
    predict.add_argument("--save-txt", action="store_true", help="YOLO label files under labels/")
    predict.add_argument("--save-conf", action="store_true", help="scores in the label files")
    predict.add_argument("--save-json", action="store_true", help="COCO results in predictions.json")
    predict.add_argument("--save-crop", action="store_true", help="each detection's crop under crops/<class>/")
    predict.add_argument("--out", help="run folder (default: runs/predict, runs/predict2, ...)")
    predict.set_defaults(func=run_predict)

    compare = sub.add_parser("compare", help="training runs side by side: mAP, epochs, hours, config differences",
                             description="Reads each run folder's results.csv and config.yaml.")
    compare.add_argument("runs", nargs="+", help="run folders (runs/train runs/train2 ...)")
    compare.set_defaults(func=run_compare)

    add_deploy_commands(sub, model_flags)   # export, benchmark

    data = sub.add_parser("data", help="dataset tools: `data shard` writes a dataset as shards")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    shard = data_sub.add_parser("shard", help="write a YOLO or COCO dataset as shards, to a folder or s3://",
                                description="Writes every split of SRC (a data.yaml or its folder, a COCO json, "
                                "or 'shapes') as litdata chunks with a label index. OUT is a folder or "
                                "s3://bucket/prefix (credentials and endpoint from AWS_ACCESS_KEY_ID, "
                                "AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL). Running it again continues a write "
                                "that stopped.")
    shard.add_argument("src", help="data.yaml, its folder, a COCO instances json, or 'shapes'")
    shard.add_argument("out", help="a folder or s3://bucket/prefix")
    shard.add_argument("--splits", help="the splits to write, e.g. train,val (default: all the yaml names)")
    shard.add_argument("--chunk-bytes", default="64MB", help="the size of a shard file (default 64MB)")
    shard.add_argument("--image-dir", help="COCO only: the image folder")
    shard.set_defaults(func=run_data_shard)

    demo = sub.add_parser("demo", help="run an untrained model on generated images and print what it finds")
    model_flags(demo, conf=0.0, imgsz=320, weights=False, end_to_end=False)
    demo.set_defaults(max_det=5)
    demo.add_argument("--images", type=int, default=4, help="how many images to generate")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", default="runs/demo", help="output folder")
    demo.set_defaults(func=run_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs a subcommand; returns the exit code (2: bad input; 130 / 143: stopped by SIGINT / SIGTERM).

    Ctrl-C and SIGTERM stop any command with one line and no traceback (``train`` stops at an
    optimizer step and saves first); a second one stops it at once.
    """
    args = build_parser().parse_args(argv)
    stop = GracefulStop()    # the trainer installs its own while it trains
    formatter, warnings.formatwarning = warnings.formatwarning, lambda m, c, *_: _warning_line(args.command, m, c)
    try:
        with stop:
            code = args.func(args)
        if stop.received:                 # a signal whose exception Python dropped: stop now
            raise Interrupted(stop.received)
        return code
    except (FileNotFoundError, ValueError, ImportError, TrackerError) as exc:   # what the user can mend
        print(f"yolokit {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except StoreError as exc:             # the object store: credentials refused (2), or it stopped answering (1)
        print(f"yolokit {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return 2 if isinstance(exc, CredentialsError) else 1
    except (SaveError, LaunchError) as exc:   # a full disk, or a store that stopped under several processes
        saved = exc if isinstance(exc, SaveError) else next(   # (every rank raised it): one line
            (e for _, e in sorted(exc.errors.items()) if isinstance(e, (SaveError, StoreError))), None)
        if saved is None:
            raise
        print(f"yolokit {args.command}: error: {one_line(saved)}", file=sys.stderr)
        return 1
    except DeviceFailure as exc:          # a CUDA error: said where and with which files; the context is lost
        if not getattr(exc, "reported", False):
            print(f"yolokit {args.command}: error: {exc}", file=sys.stderr)
        print(f"yolokit {args.command}: stopped: the device failed (exit 1)", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)                       # not interpreter exit: freeing CUDA memory now would abort (134)
    except (KeyboardInterrupt, SystemError) as exc:      # one line, no traceback (a SystemError: see `of`)
        interrupted = Interrupted.of(exc)
        if not interrupted.reported and distributed.is_main():
            again = ": the same command continues where it stopped" if args.command == "data" else ""
            print(f"yolokit {args.command}: stopped by {signal.Signals(interrupted.signum).name}{again}",
                  file=sys.stderr)
        return interrupted.exit_code
    finally:
        warnings.formatwarning = formatter


def _warning_line(command: str, message: Warning | str, category: type[Warning]) -> str:
    """A warning on the command line: one line naming the command, not the source line that raised it."""
    kind = "" if category in (UserWarning, RuntimeWarning) else f" ({category.__name__})"
    return f"yolokit {command}: warning{kind}: {message}\n"


if __name__ == "__main__":
    sys.exit(main())
