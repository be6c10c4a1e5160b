"""Building a run from its config: every part at the line where it is made, in order.

:func:`build_run` is what :meth:`yolokit.train.Trainer.setup` runs: processes and device,
run folder, data, model and loss, then each accel piece (activation checkpointing, memory
layout, compile, precision, the batch, SyncBatchNorm, the Accumulator), the loaders, the
optimizer and its schedule, and a resumed checkpoint's state. It returns the frozen
:class:`~yolokit.train.state.Parts` and the :class:`~yolokit.train.state.Progress`.
"""

from __future__ import annotations

import os
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from yolokit.accel import Accumulator, GracefulStop, Precision, RankExchange, Watchdog, distributed, perf
from yolokit.accel.checkpointing import enable_activation_checkpointing
from yolokit.accel.graphs import StepGraphs
from yolokit.data import DetectionDataset, build_dataloader
from yolokit.data.augment.segment_items import read_masks
from yolokit.data.store.cap import CacheUse, share_cache
from yolokit.losses import YOLO26Loss, YOLO26SegLoss, YOLOv3Loss, YOLOv8Loss, YOLOv8SegLoss
from yolokit.models import Detector, build_model, config_from_dict, create_model
from yolokit.models.heads import AnchorHead, DFLHead, EndToEndHead
from yolokit.train.autobatch import resolve_batch, training_probe, worst_case_boxes
from yolokit.train.callbacks import Callback
from yolokit.train.checkpoint import resolve_run, restore_run
from yolokit.train.config import TrainConfig, check_model_name
from yolokit.train.ema import ModelEMA
from yolokit.train.files import write_text
from yolokit.train.freeze import freeze, freeze_prefixes
from yolokit.train.optim import LRSchedule, build_optimizer, resolve_bias_lr, resolve_optimizer
from yolokit.train.plan import Processes, RuntimePlan, device_settings, runtime_plan, start_processes
from yolokit.train.scales import MultiScale
from yolokit.train.state import Parts, Progress, StepVotes
from yolokit.train.step import GraphStep, graphs_off_reason
from yolokit.train.trackers.catalog import run_callbacks
from yolokit.train.weights import DEFAULT_MODEL, read_pretrained, transfer_weights


@dataclass(frozen=True)
class Built:
    """What :func:`build_run` returns: the parts, where the run is, and what setup has to say."""

    parts: Parts
    progress: Progress
    resume_meter: dict | None           # this rank's loss sums of a resumed epoch's completed steps
    summary: dict                       # the run header (``Callback.on_setup_end``)


def build_run(config: TrainConfig, *, user_callbacks: list[Callback], model: Detector | None = None) -> Built:
    """Processes, run folder, data, model, loss, and each accel piece where it acts (see the module).

    ``model``: a Detector to train instead of the one ``config`` names (any of yours).
    """
    procs = start_processes(config)              # device (made current), rank, local rank, world
    cfg, resume, run_dir = resolve_run(config)
    if model is None and resume is None and not cfg.weights and cfg.model is not None:
        check_model_name(cfg.model)              # a misspelt name fails before the datasets are scanned
    run_dir = distributed.broadcast_object(run_dir)
    seed_everything(cfg.seed + procs.rank)
    settings = device_settings(cfg, procs)       # precision, layout, kernels, workers: what the device decides
    settings.apply()                             # CUDA: benchmark, TF32, fast kernels; CPU: deterministic
    callbacks = run_callbacks(run_dir, main=procs.main, plots=cfg.plots, trackers=cfg.tracker, user=user_callbacks,
                              verbose=cfg.verbose)
    notes: list[str] = []                        # lines for on_setup_end

    train_set, val_set = build_datasets(cfg, procs, notes.append)   # every rank scans: none waits in a collective
    names = list(train_set.names.values()) if isinstance(train_set.names, dict) else list(train_set.names)

    # model and loss: the model given, a resumed run's architecture, pretrained weights' or config.model's;
    # every process starts from the main one's weights
    cfg, model = run_model(cfg, len(names), given=model, resume=resume, report=notes.append)
    if getattr(model.head, "segments", False):   # a segmentation model: its training items carry masks
        read_masks(train_set, f"{cfg.data} (train)", mask_ratio=cfg.mask_ratio, overlap=cfg.overlap_mask)
        #          validation scores masks against the val split's own polygons (val.masks), not the items' masks
    if model.config is None:
        notes.append(f"no weights/model.pt at the end: {model.name} holds no architecture as data (a model YAML "
                     "or a built-in does); its weights are in weights/last.pt")
    stride = int(max(model.strides))             # what image sizes and rect shapes are multiples of
    if cfg.imgsz % stride:
        raise ValueError(f"imgsz {cfg.imgsz} must be a multiple of {cfg.model}'s largest stride, {stride}")
    frozen = tuple(freeze_prefixes(model, cfg.freeze))   # no gradient, no decay, BatchNorm statistics held
    if frozen:
        notes.append(f"frozen: {freeze(model, list(frozen)):,} parameters of {', '.join(frozen)}")
    model.to(procs.device)
    distributed.broadcast_module(model)
    criterion = build_loss(model, cfg)
    if cfg.checkpointing:
        enable_activation_checkpointing(model.checkpoint_units(cfg.checkpointing))
    perf.prepare_model(model, channels_last=settings.channels_last or None)
    precision = Precision(settings.precision, procs.device)
    ema = ModelEMA(model, cfg.ema_decay, cfg.ema_tau, frozen=frozen) if cfg.ema else None
    train_net = perf.prepare_model(model, compile=bool(cfg.compile), compile_mode=cfg.compile or None)
    if cfg.compile:   # the loss too: ~300 small ops a step (yolov8n), fused; its sizes follow max_boxes (dynamic);
        #               the default mode: CUDA graphs would reuse its outputs' memory at the next call
        criterion = perf.prepare_model(criterion, compile=True, compile_dynamic=True)
    augments_on_device = settings.augment_on == "device" or settings.hsv_on_device
    compiled = (["the training network and its loss"] if cfg.compile else []) + (
        ["the device's augmentation"] if settings.compile_augment and augments_on_device else [])
    if compiled:      # the first step waits for it, silently otherwise
        notes.append(f"torch.compile compiles {' and '.join(compiled)} on the first step (seconds on a GPU "
                     "machine, minutes on a few CPU cores); later steps reuse the kernels")

    # batch: the total over processes; "auto" probes the worst case once, the smallest fit over ranks
    scale = MultiScale(cfg.imgsz, stride, cfg.seed, enabled=cfg.multi_scale)
    probe = training_probe(model, train_net, criterion, precision, procs.device, imgsz=scale.largest,
                           val_imgsz=cfg.imgsz, max_boxes=worst_case_boxes(train_set, cfg),
                           channels_last=settings.channels_last, world=procs.world, sync_bn=settings.sync_bn,
                           state_tensors=1 if cfg.optimizer.lower() == "sgd" else 2)
    batch = resolve_batch(cfg, probe, procs.device, resumed=resume, report=notes.append, world=procs.world,
                          main=procs.main)
    if settings.sync_bn:                         # collectives in every forward and backward: no OOM split
        distributed.convert_sync_batchnorm(model, procs.device)
    # the runtime plan: per-rank batch, accumulation, steps per epoch, worked out here only
    plan = runtime_plan(procs, batch=batch, nominal_batch=cfg.nbs, train_size=len(train_set),
                        whole_steps=settings.sync_bn)
    accumulator = Accumulator(train_net, accumulate=plan.accumulate, rank=plan.rank, world_size=plan.world,
                              min_micro_batch=plan.per_rank if settings.sync_bn else 1)
    loader = build_dataloader(train_set, plan.per_rank, workers=settings.workers, shuffle=True, seed=cfg.seed,
                              pin_memory=settings.pin_memory, uint8_images=True, accumulate=plan.accumulate,
                              whole_steps=settings.sync_bn, rect=cfg.rect, stride=stride,
                              hsv_on_device=settings.hsv_on_device, augment_on=settings.augment_on,
                              rank=plan.rank, world_size=plan.world)
    val_loader = build_dataloader(val_set, plan.per_rank * 2, workers=settings.workers, shuffle=False,
                                  seed=cfg.seed, pin_memory=settings.pin_memory, uint8_images=True, stride=stride,
                                  rank=plan.rank, world_size=plan.world)

    end_to_end = bool(getattr(model.head, "end_to_end", False))
    opt_name, lr0, momentum = resolve_optimizer(cfg.optimizer, cfg.lr0, cfg.momentum, num_classes=len(names),
                                                iterations=plan.steps_per_epoch * cfg.epochs, end_to_end=end_to_end)
    bias_lr = resolve_bias_lr(cfg.warmup_bias_lr)
    decay = cfg.weight_decay * plan.images_per_step / cfg.nbs
    optimizer = build_optimizer(model, opt_name, lr0, momentum, decay, fused=settings.fused_optimizer)
    schedule = LRSchedule(lr0, cfg.lrf, cfg.epochs, plan.steps_per_epoch, cfg.warmup_epochs,
                          cfg.warmup_momentum, bias_lr, momentum, cfg.cos_lr, cfg.warmup_min_steps)
    graphs = step_graphs(cfg, plan, train_net, criterion, precision, optimizer, report=notes.append)
    parts = Parts(config=cfg, plan=plan, settings=settings, run_dir=run_dir, callbacks=tuple(callbacks),
                  names=tuple(names), train_set=train_set, loader=loader, val_loader=val_loader, model=model,
                  train_net=train_net, criterion=criterion, precision=precision, accumulator=accumulator,
                  optimizer=optimizer, schedule=schedule, ema=ema, frozen=frozen, scale=scale,
                  watchdog=Watchdog(cfg.max_bad_steps), stop=GracefulStop(several=plan.world > 1),
                  exchange=RankExchange(StepVotes, world_size=plan.world), graphs=graphs,
                  data_check=plan.world > 1 and any(d.index.store is not None and d.index.store.remote
                                                    for d in (train_set, val_set)))
    progress, resume_meter = Progress(), None
    if getattr(model.head, "segments", False) and val_set.index.segments is not None:
        progress.result.mask_map50 = progress.result.mask_map50_95 = 0.0   # results.csv's mask columns from row 1
    if resume is not None:
        resume_meter = restore_run(parts, progress, resume)
        notes.append(resume_note(parts, progress))
    if plan.main:
        (run_dir / "weights").mkdir(parents=True, exist_ok=True)
        write_text(run_dir / "config.yaml", cfg.to_yaml())
    summary = dict(model=cfg.model, data=cfg.data, classes=len(names), world=plan.world, device=str(plan.device),
                   batch=batch, per_process=plan.per_rank, accumulate=plan.accumulate,
                   step_batch=plan.images_per_step, optimizer=opt_name, lr0=lr0, precision=precision.precision,
                   layout=perf.describe(train_net), workers=settings.workers,
                   threads=torch.get_num_threads(), sync_bn=settings.sync_bn,
                   config=cfg.to_yaml(), config_file=str(run_dir / "config.yaml"), changed=changes_line(cfg),
                   notes=notes,
                   shard_cache=CacheUse([d.index.store for d in (train_set, val_set) if d.index.store is not None]))
    return Built(parts, progress, resume_meter, summary)


def step_graphs(cfg: TrainConfig, plan: RuntimePlan, train_net: nn.Module, criterion: nn.Module, precision: Precision,
                optimizer: torch.optim.Optimizer, *, report: Callable[[str], None]) -> StepGraphs | None:
    """The step's CUDA graphs when ``cfg.cuda_graphs`` asks for them and the run allows them (else a
    note says why not, and the step runs eagerly)."""
    if not cfg.cuda_graphs:
        return None
    reason = graphs_off_reason(cfg, device=plan.device, world=plan.world, criterion=criterion, optimizer=optimizer)
    if reason is not None:
        report(f"cuda_graphs: off, the step runs eagerly: {reason}")
        warnings.warn(f"cuda_graphs cannot record this run's step: {reason}; it runs eagerly", RuntimeWarning,
                      stacklevel=3)
        return None
    report("cuda_graphs: each step shape (batch, image size, boxes padded to 8, 16, 32, ...) is recorded after "
           "two eager steps with the same learning rate, so from the end of the warmup, once per epoch")
    return StepGraphs(GraphStep(train_net, criterion, precision, optimizer, cfg.clip_grad_norm or None), plan.device)


def run_model(cfg: TrainConfig, classes: int, *, given: Detector | None, resume: dict | None,
              report: Callable[[str], None]) -> tuple[TrainConfig, Detector]:
    """The model a run trains, and the config naming it.

    In order: the Detector given; a resumed run's architecture, as its checkpoint holds it (a
    YAML's content, not the file as it is now); the architecture of pretrained ``weights``
    (their tensors transferred); ``cfg.model``, else yolov8n.
    """
    if given is not None:
        if given.num_classes != classes:
            raise ValueError(f"the model given has {given.num_classes} classes, the data {classes}")
        return cfg.replace(model=cfg.model or given.name), given
    if resume is not None:
        if not resume.get("model_config"):
            raise ValueError(f"{cfg.resume} trained a model given as an instance, whose architecture a checkpoint "
                             "cannot hold: pass it again, Trainer(config, model=...)")
        return cfg, build_model(replace(config_from_dict(resume["model_config"]), num_classes=classes))
    if cfg.weights:
        source = read_pretrained(cfg.weights, cfg.model)
        model = build_model(replace(source.config, num_classes=classes))
        transfer_weights(model, source, path=cfg.weights, report=report)
        return cfg.replace(model=cfg.model or source.name), model
    name = cfg.model or DEFAULT_MODEL
    return cfg.replace(model=name), create_model(name, num_classes=classes)


def build_loss(model: Detector, config: TrainConfig) -> nn.Module:
    """The loss the model's head calls for, from the head's facts and the config's gains.

    A DFL head (YOLOv8, YOLO11, any anchor-free YAML model) trains with :class:`YOLOv8Loss` at
    its levels and strides; an end-to-end head (YOLO26) with :class:`YOLO26Loss` (its branch
    weights set per epoch by the trainer, ``set_epoch``); an anchor head (YOLOv3) with
    :class:`YOLOv3Loss`. A segmentation head's loss adds the mask term: :class:`YOLOv8SegLoss`,
    :class:`YOLO26SegLoss` (``overlap_mask``: the masks' form).
    """
    head = model.head
    gains = dict(box=config.box, cls=config.cls, dfl=config.dfl)
    if config.min_gt_side is not None:        # else each loss's own
        gains["min_gt_side"] = config.min_gt_side
    if getattr(head, "segments", False):   # the detection terms as below, and the mask term
        seg = dict(gains, num_masks=head.num_masks, overlap=config.overlap_mask)
        if isinstance(head, EndToEndHead):
            return YOLO26SegLoss(head.num_classes, head.strides, reg_max=head.reg_max, **seg)
        return YOLOv8SegLoss(head.num_classes, head.strides, reg_max=head.reg_max, **seg)
    if isinstance(head, EndToEndHead):
        return YOLO26Loss(head.num_classes, head.strides, reg_max=head.reg_max, **gains)
    if isinstance(head, DFLHead):
        return YOLOv8Loss(head.num_classes, head.strides, reg_max=head.reg_max, **gains)
    if isinstance(head, AnchorHead):
        if config.min_gt_side is not None:
            raise ValueError(f"min_gt_side {config.min_gt_side:g}: a YOLOv3 anchor head's loss matches anchors, "
                             "it has no task-aligned assigner to widen GTs for; leave min_gt_side unset")
        return YOLOv3Loss(head.num_classes, head.anchors, head.strides)
    raise TypeError(f"no loss for a {type(head).__name__} head: the trainer trains DFLHead (YOLOv8Loss), "
                    "EndToEndHead (YOLO26Loss) and AnchorHead (YOLOv3Loss) detectors")


def resume_note(parts: Parts, progress: Progress) -> str:
    """Where a resumed run continues, and what is not exact about it."""
    if not progress.step_in_epoch:
        return f"resuming after epoch {progress.epoch}"
    note = f"resuming at optimizer step {progress.step_in_epoch} of epoch {progress.epoch + 1}"
    data, cfg = parts.train_set, parts.config
    mosaic = (data.augment and not data.rect and data.hyp.mosaic > 0
              and progress.epoch < cfg.epochs - cfg.close_mosaic)   # Mosaic on in the epoch that resumes
    if data.buffer_size and mosaic:
        note += (" (mosaic_buffer > 0: the rest of this epoch draws Mosaic partners from a buffer that starts "
                 "empty here, so it differs from an uninterrupted run; later epochs do not)")
    return note


def changes_line(cfg: TrainConfig, limit: int = 160) -> str:
    """The config's fields set away from their defaults, as ``name=value`` pairs on one line of at most
    ``limit`` characters (the rest counted: the whole config is the run's config.yaml)."""
    pairs = [f"{k}={v}" for k, v in cfg.changes().items() if k not in ("verbose",)]
    line = ""
    for i, pair in enumerate(pairs):
        more = f", and {len(pairs) - i} more"
        if len(line) + len(pair) + 2 + len(more) > limit and i < len(pairs) - 1:
            return line + more
        line = f"{line}, {pair}" if line else pair
    return line


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's global generators, seeded."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_datasets(cfg: TrainConfig, procs: Processes, report: Callable[[str], None] = print
                   ) -> tuple[DetectionDataset, DetectionDataset]:
    """The train and val splits, built by every process itself: nobody waits in a collective.

    A rank that waited for rank 0's scan of a large dataset would wait in a collective and could
    trip its timeout (``dist_timeout``); scanning on every rank keeps them in step. The label
    cache is written atomically and the built-in ``shapes`` set is generated atomically, so
    ranks that race to write them read whole files. ``fraction`` draws the training images
    with ``seed`` (the same on every rank and after a resume); ``classes`` and ``single_cls``
    apply to both splits. ``report`` receives what they left out.
    """
    chosen = dict(classes=cfg.classes, single_cls=cfg.single_cls, shards={"max_cache": cfg.shard_cache})
    train_set = DetectionDataset(cfg.data, "train", imgsz=cfg.imgsz, augment=True, hyp=cfg.augment,
                                 cache_images=cfg.cache, cache_peers=cache_peers("train", procs),
                                 buffer_size=cfg.mosaic_buffer, fraction=cfg.fraction, subset_seed=cfg.seed, **chosen)
    val_set = DetectionDataset(cfg.data, "val", imgsz=cfg.imgsz, rect=True, cache_images=cfg.cache,
                               cache_peers=cache_peers("val", procs), **chosen)
    share_cache([d.index.store for d in (train_set, val_set) if d.index.store is not None], cfg.shard_cache)
    for split, data in (("train", train_set), ("val", val_set)):
        for note in data.selection_notes:
            report(f"{split}: {note}")
    return train_set, val_set


def cache_peers(split: str, procs: Processes) -> tuple[int, int, str]:
    """``(local_rank, local_world, token)``: the processes of this machine share one image cache per
    split (``cache="ram"``) and split its filling; the token names this run and this start of it
    (a torchrun restart builds a new cache)."""
    env = os.environ
    token = "|".join([split, env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", ""),
                      env.get("TORCHELASTIC_RUN_ID", ""), env.get("TORCHELASTIC_RESTART_COUNT", "")])
    return procs.local_rank, procs.local_world, token

