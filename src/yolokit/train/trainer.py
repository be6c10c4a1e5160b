"""The training loop, composed in plain sight.

``Trainer(config).fit()`` reads top to bottom like a loop written by hand: build the
data, the model and the loss; then each ``accel`` piece at the line where it acts
(activation checkpointing, channels_last / compile, Precision, batch-size finder, DDP,
Accumulator, OOMGuard); then epochs of forward / loss / backward / step, validation,
atomic checkpoints and callbacks.

Loss scale: yolokit's losses are normalized per batch; like Ultralytics' trainer, the
loop backpropagates ``loss * images`` of each micro-batch, so the YOLOv8 SGD learning
rates mean the same here. Gradients are summed over the accumulation steps of a nominal
batch of ``nbs`` images and clipped to norm 10 before each step.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from yolokit.accel import distributed, perf
from yolokit.accel.accumulation import Accumulator
from yolokit.accel.amp import Precision
from yolokit.accel.batch_size import OOMGuard, find_batch_size
from yolokit.accel.checkpointing import enable_activation_checkpointing
from yolokit.data import DetectionDataset, build_dataloader, to_device
from yolokit.losses import YOLOv3Loss, YOLOv8Loss
from yolokit.models import Detector, create_model
from yolokit.train.callbacks import Callback, CSVLogger, Plotter, ProgressBar, TensorBoardLogger
from yolokit.train.checkpoint import atomic_save, load_checkpoint, rng_states, set_rng_states
from yolokit.train.config import TrainConfig
from yolokit.train.ema import ModelEMA
from yolokit.train.evaluate import EvalResult, validate
from yolokit.train.optim import LRSchedule, build_optimizer, resolve_optimizer
from yolokit.train.weights import export_final, load_pretrained


class TrainingDiverged(RuntimeError):
    """The loss stayed non-finite for ``max_bad_steps`` steps; the last good checkpoint is kept."""


def build_loss(model: Detector, config: TrainConfig) -> nn.Module:
    """The family's loss, from the head's facts."""
    head = model.head
    if model.config.family == "yolov8":
        return YOLOv8Loss(head.num_classes, head.strides, reg_max=head.reg_max,
                          box=config.box, cls=config.cls, dfl=config.dfl)
    return YOLOv3Loss(head.num_classes, head.anchors, head.strides)


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True


def fitness(result: EvalResult) -> float:
    """Model selection score: 0.1 mAP50 + 0.9 mAP50-95."""
    return 0.1 * result.map50 + 0.9 * result.map50_95


def resolve_run(config: TrainConfig) -> tuple[TrainConfig, dict[str, Any] | None, Path]:
    """(config, resume state, run folder). Resuming reads the run's last.pt; a new run never reuses a used folder."""
    if config.resume:
        path = Path(config.resume)
        path = path / "weights" / "last.pt" if path.is_dir() else path
        state = load_checkpoint(path)
        saved = TrainConfig.from_dict({**state["train_config"], "resume": str(path)})
        epochs = max(config.epochs, saved.epochs) if config.epochs != TrainConfig.epochs else saved.epochs
        return saved.replace(epochs=epochs), state, path.parent.parent
    out = Path(config.out)
    run, n = out, 2
    while (run / "results.csv").exists() or (run / "weights").exists():
        run, n = out.with_name(f"{out.name}{n}"), n + 1
    return config, None, run


class Trainer:
    """Trains a detector as ``config`` says. ``fit()`` returns the final validation metrics."""

    def __init__(self, config: TrainConfig, *, callbacks: list[Callback] | None = None):
        self.config = config
        self.user_callbacks = list(callbacks or [])

    def fit(self) -> dict[str, float]:
        # --- processes, run folder, seeds -----------------------------------------------
        device = distributed.setup() if self.config.devices > 1 else _pick_device(self.config.device)
        main = distributed.is_main()
        cfg, resume, run_dir = resolve_run(self.config)
        run_dir = distributed.broadcast_object(run_dir)
        seed_everything(cfg.seed + distributed.rank(), cfg.deterministic)
        callbacks = self._callbacks(run_dir, main)

        # --- data --------------------------------------------------------------------------
        train_set = DetectionDataset(cfg.data, "train", imgsz=cfg.imgsz, augment=True, hyp=cfg.augment_config(),
                                     cache_images=cfg.cache)
        val_set = DetectionDataset(cfg.data, "val", imgsz=cfg.imgsz, rect=True, cache_images=cfg.cache)
        names = list(train_set.names.values()) if isinstance(train_set.names, dict) else list(train_set.names)

        # --- model, loss, and the accel pieces where they act ------------------------------
        model = create_model(cfg.model, num_classes=len(names))
        if cfg.weights and resume is None:
            load_pretrained(model, cfg.weights)
        model.to(device)
        criterion = build_loss(model, cfg)
        if cfg.checkpointing:
            enable_activation_checkpointing(model.checkpoint_units(cfg.checkpointing))
        channels_last = cfg.uses_channels_last(device.type)
        perf.prepare_model(model, channels_last=channels_last or None)
        if device.type == "cuda":
            perf.configure(cudnn_benchmark=not cfg.deterministic)
        precision = Precision(cfg.precision, device)
        batch = self._batch_size(cfg, model, criterion, precision, device)
        ema = ModelEMA(model, cfg.ema_decay, cfg.ema_tau) if cfg.ema else None
        net = distributed.wrap_ddp(model)                 # DDP (a no-op in one process)
        train_net = perf.prepare_model(net, compile=cfg.compile)
        accumulator = Accumulator(cfg.nbs, batch, world_size=distributed.world_size())
        guard = OOMGuard(net)                             # halves micro-batches on OOM

        loader = build_dataloader(train_set, batch, workers=cfg.workers, shuffle=True, seed=cfg.seed,
                                  uint8_images=True)          # 4x fewer bytes; floats made on the device
        val_loader = build_dataloader(val_set, batch * 2, workers=cfg.workers, shuffle=False, seed=cfg.seed,
                                      uint8_images=True)
        iters = len(loader)
        opt_name, lr0, momentum = resolve_optimizer(
            cfg.optimizer, cfg.lr0, cfg.momentum, num_classes=len(names),
            iterations=math.ceil(len(train_set) / max(batch, cfg.nbs)) * cfg.epochs)
        decay = cfg.weight_decay * batch * accumulator.steps * distributed.world_size() / cfg.nbs
        optimizer = build_optimizer(model, opt_name, lr0, momentum, decay)
        schedule = LRSchedule(lr0, cfg.lrf, cfg.epochs, iters, cfg.warmup_epochs, cfg.warmup_momentum,
                              cfg.warmup_bias_lr, momentum, cfg.cos_lr)

        start_epoch, best, stale = 0, -1.0, 0
        if resume is not None:
            start_epoch, best, stale = self._restore(resume, model, ema, optimizer, precision, guard)
        if main:
            print(f"yolokit train: {cfg.model} on {cfg.data} ({len(names)} classes), {device}, batch {batch} x "
                  f"{accumulator.steps} accumulation, {opt_name} lr {lr0:g}, {precision.precision}, "
                  f"{perf.describe(model)}\nconfig:\n{cfg.to_yaml()}")
            (run_dir / "weights").mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(cfg.to_yaml())
        for cb in callbacks:
            cb.on_train_start(run_dir, cfg.to_dict())

        # --- epochs ----------------------------------------------------------------------------
        result, done = EvalResult(), start_epoch
        try:
            for epoch in range(start_epoch, cfg.epochs):
                train_set.mosaic = epoch < cfg.epochs - cfg.close_mosaic   # Mosaic off for the last K
                loader.set_epoch(epoch)
                net.train()
                for cb in callbacks:
                    cb.on_epoch_start(epoch, cfg.epochs, iters)
                sums, bad, started = {}, 0, time.perf_counter()
                for i, data in enumerate(loader):
                    schedule.apply(optimizer, epoch, epoch * iters + i)
                    data = to_device(data, device, non_blocking=True)
                    images = data["images"]
                    if channels_last:
                        images = images.contiguous(memory_format=torch.channels_last)
                    micro = {"images": images, "targets": data["targets"]}

                    def forward_backward(part: dict, weight: float) -> dict[str, torch.Tensor]:
                        with precision.autocast():
                            loss, parts = criterion(train_net(part["images"]), part["targets"])
                        precision.backward(loss * len(part["images"]))  # NaN grads: the step is skipped
                        return {k: v * weight for k, v in parts.items()}

                    with accumulator.micro_step(net):                     # DDP syncs on the last one
                        outputs = guard.run(forward_backward, micro)      # split on OOM
                    if accumulator.should_step():
                        self._step(precision, optimizer, model, ema)
                    parts = {k: float(sum(o[k] for o in outputs)) for k in outputs[0]}
                    bad = bad + 1 if not all(math.isfinite(v) for v in parts.values()) else 0
                    if bad >= cfg.max_bad_steps:
                        raise TrainingDiverged(
                            f"loss was not finite for {bad} steps in a row in epoch {epoch + 1}; stopped. The last "
                            f"good checkpoint is {run_dir / 'weights' / 'last.pt'}; try a lower lr0 or precision=fp32")
                    for k, v in parts.items():
                        sums[k] = sums.get(k, 0.0) + (v if bad == 0 else 0.0)
                    for cb in callbacks:
                        cb.on_batch_end(parts, len(images), _memory_gb(device))
                if accumulator.pending:                       # epochs are self-contained: flush
                    accumulator.reset()
                    self._step(precision, optimizer, model, ema)
                losses = {f"train/{k}": distributed.all_reduce_mean(v / max(iters, 1)) for k, v in sums.items()}

                last = epoch + 1 == cfg.epochs
                evaluated = main and ((epoch + 1) % cfg.val_interval == 0 or last)
                if evaluated:
                    result, samples = validate(ema.module if ema else model, val_loader, num_classes=len(names),
                                               conf=cfg.conf, iou=cfg.iou, max_det=cfg.max_det,
                                               keep_samples=16 if last and cfg.plots else 0)
                    for cb in callbacks:
                        cb.on_validation_end(result, samples, names)
                score = fitness(result)
                improved = evaluated and score > best
                best, stale = (score, 0) if improved else (best, stale + int(evaluated))
                row = {"epoch": epoch + 1, **losses, **result.as_dict(), "fitness": score,
                       "lr": optimizer.param_groups[0]["lr"], "seconds": time.perf_counter() - started}
                if main:
                    state = self._state(epoch + 1, cfg, model, ema, optimizer, precision, guard, best, stale, row)
                    atomic_save(state, run_dir / "weights" / "last.pt")
                    if improved:
                        atomic_save(state, run_dir / "weights" / "best.pt")
                done = epoch + 1
                for cb in callbacks:
                    cb.on_epoch_end(row)
                if distributed.broadcast_object(stale >= cfg.patience):
                    if main:
                        print(f"early stop: no improvement for {cfg.patience} validations")
                    break
        except KeyboardInterrupt:
            if main and done == epoch:   # stopped mid-epoch: resuming restarts it from these weights
                state = self._state(done, cfg, model, ema, optimizer, precision, guard, best, stale, {})
                atomic_save(state, run_dir / "weights" / "last.pt")
            if main:
                print(f"\ninterrupted: resume with `yolokit train --resume {run_dir}`")
            raise
        finally:
            for cb in callbacks:
                cb.on_train_end()
        if main:
            export_final(ema.module if ema else model, run_dir / "weights" / "model.pt", names, cfg)
            print(f"results in {run_dir}")
        distributed.teardown()
        return {**result.as_dict(), "fitness": fitness(result), "run_dir": str(run_dir)}

    # --- pieces of the loop ----------------------------------------------------------------

    @staticmethod
    def _step(precision: Precision, optimizer: torch.optim.Optimizer, model: nn.Module,
              ema: ModelEMA | None) -> None:
        """Unscale, clip to norm 10, step (skipped on inf/NaN gradients), zero, EMA update."""
        stepped = precision.step(optimizer, clip_grad_norm=10.0)
        optimizer.zero_grad(set_to_none=True)
        if stepped and ema is not None:
            ema.update(model)

    def _batch_size(self, cfg: TrainConfig, model: nn.Module, criterion: nn.Module, precision: Precision,
                    device: torch.device) -> int:
        if cfg.batch != "auto":
            return int(cfg.batch)
        if device.type != "cuda":
            print("batch auto: no CUDA device to measure, using 16")
            return 16
        saved = {k: v.clone() for k, v in model.state_dict().items()}

        def step(b: int) -> None:
            images = torch.rand(b, 3, cfg.imgsz, cfg.imgsz, device=device)
            targets = torch.tensor([[i, 0, 10.0, 10.0, 100.0, 100.0] for i in range(b)], device=device)
            with precision.autocast():
                loss, _ = criterion(model(images), targets)
            loss.backward()
            model.zero_grad(set_to_none=True)

        size = find_batch_size(step, start=1, max_size=512, mode="binsearch")
        model.load_state_dict(saved)
        print(f"batch auto: {size} images per step fit on {device}")
        return size

    def _callbacks(self, run_dir: Path, main: bool) -> list[Callback]:
        if not main:
            return list(self.user_callbacks)
        built = [ProgressBar(), CSVLogger(run_dir / "results.csv"), TensorBoardLogger(run_dir / "tensorboard")]
        if self.config.plots:
            built.append(Plotter(run_dir))
        return built + self.user_callbacks

    @staticmethod
    def _state(epoch: int, cfg: TrainConfig, model: nn.Module, ema: ModelEMA | None, optimizer: torch.optim.Optimizer,
               precision: Precision, guard: OOMGuard, best: float, stale: int, metrics: dict) -> dict[str, Any]:
        """Everything exact resume needs, in weights_only-loadable types."""
        return {
            "epoch": epoch, "model": model.state_dict(), "model_config": asdict(model.config),
            "ema": ema.state_dict() if ema else None, "optimizer": optimizer.state_dict(),
            "precision": precision.state_dict(), "oom_splits": guard.splits, "best_fitness": best,
            "stale": stale, "train_config": cfg.to_dict(), "metrics": metrics, "rng": rng_states(),
        }

    @staticmethod
    def _restore(state: dict[str, Any], model: nn.Module, ema: ModelEMA | None, optimizer: torch.optim.Optimizer,
                 precision: Precision, guard: OOMGuard) -> tuple[int, float, int]:
        model.load_state_dict(state["model"])
        if ema is not None and state.get("ema"):
            ema.load_state_dict(state["ema"])
        optimizer.load_state_dict(state["optimizer"])
        precision.load_state_dict(state["precision"])
        guard.splits = int(state.get("oom_splits", 1))
        set_rng_states(state["rng"])
        print(f"resuming after epoch {state['epoch']}")
        return int(state["epoch"]), float(state["best_fitness"]), int(state["stale"])


def _memory_gb(device: torch.device) -> float:
    return torch.cuda.memory_reserved(device) / 2**30 if device.type == "cuda" else 0.0


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available")
    return device


def _train_worker(config: TrainConfig) -> dict[str, float]:
    return Trainer(config).fit()


def train(config: TrainConfig) -> dict[str, float]:
    """Trains with ``config.devices`` processes (accel.launch) and returns rank 0's final metrics."""
    if config.devices > 1:
        from yolokit.accel.launch import launch
        return launch(_train_worker, config.devices, config)[0]
    return Trainer(config).fit()
