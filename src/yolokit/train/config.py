"""``TrainConfig``: every training knob, with the well-known YOLOv8 defaults.

A config comes from keyword arguments, a YAML file, or command-line flags named like the
fields (``--lr0 0.02``); later sources override earlier ones. The resolved config is
saved with the run as ``config.yaml``; the console names that file and the fields set away from their
defaults, on one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import io
import textwrap
import tokenize
import types
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

import yaml

from yolokit.data import AugmentConfig
from yolokit.data.store.cap import parse_size
from yolokit.models import MODELS, packaged_yamls
from yolokit.models.zoo import is_yaml_name, packaged_model
from yolokit.train.trackers.catalog import tracker_names

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")   # torch.compile's


@dataclass
class TrainConfig:
    """Training settings. Field names are the CLI flags and the YAML keys."""

    # what to train, on what
    model: str | None = None      # a variant name or a model YAML (yolo11s.yaml, my-net.yaml); None: the
    #                               architecture of `weights`, else yolov8n
    data: str = "shapes"          # a data.yaml, its folder, a COCO json, shards (a folder or s3://), or "shapes"
    weights: str | None = None    # pretrained weights (any format yolokit.load reads); they bring their variant
    freeze: int | str | None = None  # the first N layers, or name prefixes ("backbone,neck.top_down4"), kept
    #                                  as they are: no gradient, no weight decay, BatchNorm statistics fixed
    fraction: float = 1.0       # share of the training images, drawn with `seed` (the same on every rank)
    classes: str | list[int] | None = None  # train on these class ids only ("0,2"); other labels are dropped
    single_cls: bool = False    # every class trained as one, "object"
    epochs: int = 100           # passes over the training images
    time: float = 0.0           # hours; the run stops at the first step boundary past it, validated and
    #                             saved (resume continues, with the budget again); 0: no limit
    imgsz: int = 640            # a multiple of the model's largest stride (32; 64 with a P6 level)
    rect: bool = False          # aspect-ratio batches: each batch its images' stride-aligned shape, no Mosaic/MixUp
    multi_scale: bool = False   # each optimizer step a random size, 0.5x-1.5x imgsz in strides (the same on all ranks)
    batch: int | str = 16   # total over all processes (each runs batch / world), or "auto"
    nbs: int = 64                  # nominal batch: images one optimizer step represents
    # optimizer and schedule
    optimizer: str = "auto"       # SGD, AdamW, MuSGD, or auto: AdamW up to 10,000 steps, then SGD (YOLO26: MuSGD)
    lr0: float = 0.01             # initial learning rate (optimizer auto sets its own)
    lrf: float = 0.01             # final learning rate, as a fraction of lr0
    momentum: float = 0.937       # SGD momentum, AdamW beta1
    weight_decay: float = 5e-4    # scaled by the effective batch / nbs
    warmup_epochs: float = 3.0    # epochs of linear warmup (fractions allowed), counted in optimizer steps
    warmup_min_steps: int = 100   # the warmup's floor in optimizer steps (0: warmup_epochs alone)
    warmup_momentum: float = 0.8  # momentum at the warmup's start
    warmup_bias_lr: float | None = None  # the biases' learning rate at the warmup's start; None: 0.1 for every model
    #                                     (train.optim.resolve_bias_lr; YOLO26 with auto took 0 until 2026-12-04)
    cos_lr: bool = False          # a cosine schedule from lr0 to lr0 * lrf, else linear
    ema: bool = True              # keep an exponential moving average of the weights (validated and saved)
    ema_decay: float = 0.9999     # the EMA's decay once warmed up
    ema_tau: float = 2000.0       # optimizer steps over which the EMA's decay ramps up
    # loss gains
    box: float = 7.5              # the box loss's gain
    cls: float = 0.5              # the class loss's gain
    dfl: float = 1.5              # the distribution focal loss's gain
    min_gt_side: float | None = None  # the assigner's inside test widens GT sides shorter than this (pixels) to it;
    #                                   None: the loss's own (YOLO26: 16 at strides 8-32, as the reference; YOLOv8: 0)
    # segmentation models (yolov8n-seg ...): the masks the loss trains against
    overlap_mask: bool = True     # one index map per image (larger objects under smaller); False: a mask per object
    mask_ratio: int = 4           # masks at 1/N of the image's size
    # augmentation: the data pipeline's own config (flags and flat YAML keys name its fields: --hsv-h)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    close_mosaic: int = 10        # the last N epochs train without Mosaic and MixUp
    mosaic_buffer: int = 64  # recent images Mosaic partners come from; 0: any image (augmentation then
    #                          depends on (seed, epoch, image) only: the same for any number of processes)
    # speed
    precision: str = "auto"       # fp32, fp16 (with a GradScaler), bf16; auto: bf16 or fp16 on CUDA, fp32 on the CPU
    checkpointing: str | None = None  # recompute activations of the backbone, neck or all: less memory
    channels_last: bool | None = None  # NHWC model and images; None: on for the CPU and CUDA
    #                                    (models.prefers_channels_last)
    compile: bool | str = False   # torch.compile the training network: True ("default"), or a mode: "reduce-overhead"
    #                               (CUDA graphs: fewer launches, for small models), "max-autotune" (accel.perf)
    device: str = "auto"          # auto (CUDA when available), cpu, cuda or cuda:N
    devices: int = 1              # processes to start on this machine (one per GPU); under torchrun leave it 1
    dist_timeout: float = 30.0   # minutes any collective may wait for the other processes
    sync_bn: bool = False  # SyncBatchNorm over the processes (several CUDA processes only)
    workers: int | None = None  # loader processes; None: CPU cores per process - 1 on CUDA, 2 on the CPU
    tf32: bool | None = None    # TF32 in float32 matmuls and convolutions; None: on with CUDA
    hsv_on_device: bool | None = None  # the HSV augmentation on the device, not in the loader; None: on with CUDA
    augment_on: str = "auto"  # the whole augmentation in the loader's "workers" or on the "device" (decode, Mosaic,
    #                           warp, MixUp, HSV, flips: data.augment.device_augment); "auto": the workers (train.plan)
    compile_augment: bool = False  # the device's augmentation (the pass, or the HSV step) through torch.compile:
    #                                a few fused kernels, the same images, compiled once (data.augment.fused)
    cuda_graphs: bool = False   # each step recorded as a CUDA graph and replayed with one launch (accel.graphs): for
    #                             small models held back by launches; one process, fused SGD or AdamW
    cache: bool | str = False   # decoded images kept: "ram" (True; one copy per machine) or "disk" (reused)
    shard_cache: str = "25GB"   # data from remote shards (s3://): the cap of the local cache of their chunks (the
    #                             splits share it by size), in cache_home()/shards
    monitor: bool | None = None  # the device's busy share, peak memory, temperature and power per epoch (results.csv,
    #                              console, trackers) and a warning when the GPU starves; None: on with CUDA
    # reproducibility, output, control
    seed: int = 0                 # every random draw of the run follows from it
    deterministic: bool | None = None  # deterministic kernels; None: on the CPU (exact resume), off on CUDA
    out: str = "runs/train"       # the run folder (out2, out3, ... when it holds a run already)
    resume: str | None = None   # a run folder or its last.pt; "auto": the run is `out` itself, resumed
    #                             when out/weights/last.pt exists (what restarted torchrun groups need)
    save_period_iters: int = 0  # also write weights/last.pt every N optimizer steps (0: at epoch ends only)
    save_period: int = 0        # also keep weights/epoch{N}.pt every N epochs (0: never)
    val_interval: int = 1         # validate every N epochs (the last epoch always)
    patience: int = 50            # stop after N validations in a row without a better fitness
    conf: float = 0.001           # validation's score threshold
    iou: float = 0.7              # validation's NMS IoU threshold
    max_det: int = 300            # validation's most detections per image
    max_bad_steps: int = 10     # the watchdog: this many steps in a row with a non-finite loss, or skipped for
    #                             inf/NaN gradients (fp16: once the loss scale fell below 1), stop the run; 0: never
    clip_grad_norm: float = 10.0  # the gradients' total norm is clipped to this before each step; 0: no clipping
    plots: bool = True            # draw results.png and the last validation's curves and images
    verbose: bool = True          # the header, a bar per epoch and the validation lines; False (--quiet): one
    #                               line per epoch and the final metrics
    tracker: str | list[str] | None = None   # experiment trackers: wandb, mlflow, tensorboard, csv ("wandb,csv")

    def __post_init__(self) -> None:
        if isinstance(self.augment, dict):  # from YAML or a checkpoint's train_config
            self.augment = _augment(self.augment, {})
        if isinstance(self.freeze, list):                 # YAML: a list of name prefixes
            self.freeze = ",".join(str(n) for n in self.freeze)
        if isinstance(self.freeze, str) and self.freeze.strip().isdigit():   # the CLI gives strings
            self.freeze = int(self.freeze)
        if isinstance(self.classes, str):                 # the CLI gives "0,2"
            try:
                self.classes = [int(c) for c in self.classes.replace(" ", ",").split(",") if c]
            except ValueError:
                raise ValueError(f"classes must be class ids such as 0,2; got {self.classes!r}") from None
        self.tracker = tracker_names(self.tracker) or None   # names checked; a list
        if isinstance(self.cache, str):                   # the CLI and YAML give strings
            cache = {"ram": "ram", "true": "ram", "disk": "disk", "false": False, "none": False, "": False}
            if self.cache.lower() not in cache:
                raise ValueError(f"cache must be ram, disk or false, got {self.cache!r}")
            self.cache = cache[self.cache.lower()]
        self.cache = "ram" if self.cache is True else self.cache
        try:
            parse_size(self.shard_cache)
        except ValueError:
            raise ValueError(f"shard_cache: expected a size such as 25GB or 512MB, got {self.shard_cache!r}") from None
        if isinstance(self.compile, str):                 # the CLI and YAML give strings
            mode = {"true": "default", "false": False, "none": False, "": False}.get(self.compile.lower(),
                                                                                   self.compile.lower())
            if mode not in (False, *COMPILE_MODES):
                raise ValueError(f"compile must be true, false or one of {', '.join(COMPILE_MODES)}; "
                                 f"got {self.compile!r}")
            self.compile = mode
        self.compile = "default" if self.compile is True else self.compile
        if isinstance(self.batch, str) and self.batch != "auto":
            try:
                self.batch = int(self.batch)
            except ValueError:
                raise ValueError(f"batch must be an integer or 'auto', got {self.batch!r}") from None
        checks = [
            (self.epochs >= 1, f"epochs must be >= 1, got {self.epochs}"),
            (self.imgsz >= 1, f"imgsz must be a positive multiple of the model's stride, got {self.imgsz}"),
            (self.batch == "auto" or self.batch >= 1, f"batch must be >= 1 or 'auto', got {self.batch}"),
            (self.optimizer.lower() in ("auto", "sgd", "adamw", "musgd"),
             f"optimizer must be SGD, AdamW, MuSGD or auto, got {self.optimizer}"),
            (self.precision in ("auto", "fp32", "fp16", "bf16"),
             f"precision must be auto/fp32/fp16/bf16, got {self.precision}"),
            (self.checkpointing in (None, "backbone", "neck", "all"),
             f"checkpointing must be backbone/neck/all, got {self.checkpointing}"),
            (self.devices >= 1, f"devices must be >= 1, got {self.devices}"),
            (self.workers is None or self.workers >= 0, f"workers must be >= 0, got {self.workers}"),
            (self.augment_on in ("auto", "workers", "device"),
             f"augment_on must be auto, workers or device, got {self.augment_on}"),
            (self.mosaic_buffer >= 0, f"mosaic_buffer must be >= 0, got {self.mosaic_buffer}"),
            (self.nbs >= 1, f"nbs must be >= 1, got {self.nbs}"),
            (self.warmup_min_steps >= 0, f"warmup_min_steps must be >= 0, got {self.warmup_min_steps}"),
            (self.save_period_iters >= 0, f"save_period_iters must be >= 0, got {self.save_period_iters}"),
            (self.save_period >= 0, f"save_period must be >= 0, got {self.save_period}"),
            (self.val_interval >= 1, f"val_interval must be >= 1 epochs (the last epoch always validates), "
                                     f"got {self.val_interval}"),
            (self.time >= 0, f"time must be >= 0 hours, got {self.time}"),
            (0 < self.fraction <= 1, f"fraction must be in (0, 1], got {self.fraction}"),
            (self.classes is None or len(self.classes) > 0, "classes must name at least one class id"),
            (self.dist_timeout > 0, f"dist_timeout must be > 0 minutes, got {self.dist_timeout}"),
            (self.max_bad_steps >= 0, f"max_bad_steps must be >= 0, got {self.max_bad_steps}"),
            (self.clip_grad_norm >= 0, f"clip_grad_norm must be >= 0, got {self.clip_grad_norm}"),
            (self.warmup_bias_lr is None or self.warmup_bias_lr >= 0,
             f"warmup_bias_lr must be >= 0, got {self.warmup_bias_lr}"),
            (self.min_gt_side is None or self.min_gt_side >= 0, f"min_gt_side must be >= 0, got {self.min_gt_side}"),
            (not isinstance(self.freeze, int) or self.freeze >= 0, f"freeze must be >= 0, got {self.freeze}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """A config from a dict; unknown keys are an error that names them.

        Augmentation comes nested (``augment: {hsv_h: ...}``, as ``to_dict`` writes it) or
        flat (``hsv_h: ...``, as Ultralytics configs and the flags name it); flat keys win.
        """
        flat = {k: v for k, v in data.items() if k in AUGMENT_FIELDS}
        rest = {k: v for k, v in data.items() if k not in AUGMENT_FIELDS}
        unknown = sorted(set(rest) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown TrainConfig fields: {', '.join(unknown)}")
        return cls(**{**rest, "augment": _augment(rest.get("augment") or {}, flat)})

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> TrainConfig:
        """A config from a YAML file, with keyword overrides."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a config file must hold a mapping of field names to values")
        return cls.from_dict({**data, **overrides})

    def changes(self) -> dict[str, Any]:
        """The fields set to other values than their defaults (augmentation fields flat, as the flags name them)."""
        default, mine = TrainConfig(), self.to_dict()
        flat = {**{k: v for k, v in mine.items() if k != "augment"}, **mine["augment"]}
        base = {**{k: v for k, v in default.to_dict().items() if k != "augment"}, **asdict(default.augment)}
        return {k: v for k, v in flat.items() if v != base[k]}

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes``; augmentation fields may be named flat (``mosaic=0.0``)."""
        flat = {k: changes.pop(k) for k in list(changes) if k in AUGMENT_FIELDS}
        if flat:
            changes["augment"] = dataclasses.replace(changes.get("augment", self.augment), **flat)
        return dataclasses.replace(self, **changes)


def check_model_name(name: str) -> None:
    """A built-in name or a model YAML (a path, or a packaged one such as yolo11s.yaml); else a ValueError."""
    if name not in MODELS and packaged_model(name) is None and not is_yaml_name(name):
        raise ValueError(f"unknown model {name!r}; available: {', '.join(MODELS)}, the segmentation models "
                         f"(yolov8n-seg ... yolo26x-seg), a packaged model YAML's name at a scale (yolo11n, "
                         f"yolo26s), or a model YAML (a path, or a packaged one: {', '.join(packaged_yamls())})")


AUGMENT_FIELDS = frozenset(f.name for f in fields(AugmentConfig))


def _augment(nested: AugmentConfig | dict[str, Any], flat: dict[str, Any]) -> AugmentConfig:
    """An AugmentConfig from a nested value and flat overrides; unknown keys are named."""
    values = asdict(nested) if isinstance(nested, AugmentConfig) else dict(nested)
    unknown = sorted(set(values) - AUGMENT_FIELDS)
    if unknown:
        raise ValueError(f"unknown augment fields: {', '.join(unknown)} (known: {', '.join(sorted(AUGMENT_FIELDS))})")
    return AugmentConfig(**{**values, **flat})


def _flag_type(hint: Any) -> tuple[Any, bool]:
    """(argparse type, is_bool) for a field's type hint."""
    args = [a for a in get_args(hint) if a is not type(None)]
    base = args[0] if get_origin(hint) in (Union, types.UnionType) and len(args) == 1 else hint
    if base is bool:
        return None, True
    if base in (int, float):
        return base, False
    return str, False


@functools.cache
def field_help(cls: type) -> dict[str, str]:
    """Each field's meaning, as the comment beside it in ``cls``'s source says (with its continuation
    lines, indented under it), or the field's line of the class docstring's ``Attributes:``; {} when the
    source cannot be read. What ``yolokit train --help`` and the command-line reference show. A comment
    line of the class body whose text starts right after its ``#`` heads the fields below it: it ends
    the field above."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    found: dict[str, str] = {}
    doc = inspect.getdoc(cls) or ""
    if "Attributes:" in doc:
        for line in doc.split("Attributes:", 1)[1].splitlines():
            name, sep, text = line.strip().partition(": ")
            if sep and name.isidentifier():
                found[name] = text.strip()
    current, lines = None, source.splitlines()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        row, col = token.start
        text = token.string.lstrip("#").strip()
        code = lines[row - 1][:col]
        name = code.strip().split(":", 1)[0]
        if code.strip() and ":" in code and name.isidentifier() and code.startswith("    ") and \
                not code.startswith("     "):
            current = name
            found[current] = text
        elif not code.strip() and current is not None and token.string.startswith("#  "):
            found[current] += " " + text        # a continuation, indented under the comment above
        else:
            current = None
    return found


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """Adds one ``--field`` flag per TrainConfig field (default: unset) and ``--config``."""
    parser.add_argument("--config", help="YAML file of TrainConfig fields (flags override it)")
    hints = {**get_type_hints(TrainConfig), **get_type_hints(AugmentConfig)}
    meaning = {**field_help(AugmentConfig), **field_help(TrainConfig)}
    for f in [f for f in fields(TrainConfig) if f.name != "augment"] + list(fields(AugmentConfig)):
        kind, is_bool = _flag_type(hints[f.name])
        flags = [f"--{f.name}"] + ([f"--{f.name.replace('_', '-')}"] if "_" in f.name else [])
        text = meaning.get(f.name, "").replace("%", "%%")    # argparse formats help with %
        if f.name == "cache":                     # --cache (ram), --cache disk, --cache false
            parser.add_argument(*flags, dest=f.name, nargs="?", const="ram", default=None,
                                help=f"{text}; the flag alone: ram (default: off)")
        elif f.name == "compile":                 # --compile, --compile reduce-overhead, --compile false
            parser.add_argument(*flags, dest=f.name, nargs="?", const="default", default=None,
                                help=f"{', '.join(COMPILE_MODES)} (the flag alone: default) or false (default: off)")
        elif is_bool:
            parser.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                                help=f"{text} (default: {f.default})".lstrip())
        else:
            parser.add_argument(*flags, dest=f.name, type=kind, default=None,
                                help=f"{text} (default: {f.default})".lstrip())
    parser.add_argument("--quiet", dest="verbose", action="store_false", default=None,
                        help="one line per epoch and the final metrics (the same as --no-verbose)")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig a parsed command line asks for: defaults < --config file < flags."""
    names = [f.name for f in fields(TrainConfig) if f.name != "augment"] + sorted(AUGMENT_FIELDS)
    flags = {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}
    if getattr(args, "config", None):
        return TrainConfig.from_yaml(args.config, **flags)
    return TrainConfig.from_dict(flags)
