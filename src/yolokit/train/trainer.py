"""The training loop, composed in plain sight.

``Trainer(config).fit()`` is three parts, each readable on its own: :meth:`Trainer.setup`
builds the processes, data, model, loss and each ``accel`` piece at the line where it
acts; :meth:`Trainer.train_epoch` is the loop a researcher writes by hand (the same as
``examples/custom_loop.py``); :meth:`Trainer.end_epoch` validates, checkpoints and
reports.

Semantics that do not depend on the number of processes: ``batch`` is the total over all
processes (each runs ``batch / world`` images per loader batch); an optimizer step
accumulates ``round(nbs / batch)`` loader batches per process; the losses are normalized
per batch and the loop backpropagates ``loss * images`` of each micro-batch (as
Ultralytics does, so YOLOv8 SGD learning rates mean the same), summed over micro-batches
and processes; weight decay is scaled by ``effective batch / nbs``; the learning-rate
schedule counts optimizer steps. N processes therefore take the steps one process takes
over the same micro-batches (:class:`yolokit.data.ShardedBatchSampler` hands them out,
:class:`yolokit.accel.Accumulator` sums them), and validation covers the whole split.

Resume is exact at any optimizer step (see :mod:`yolokit.train.checkpoint`): ``last.pt``
is written at epoch ends, every ``save_period_iters`` steps, and on Ctrl-C / SIGTERM at
the last completed step (:class:`yolokit.accel.stop.GracefulStop`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from yolokit.accel import distributed, perf
from yolokit.accel.accumulation import Accumulator
from yolokit.accel.amp import Precision, TrainingDiverged
from yolokit.accel.checkpointing import enable_activation_checkpointing
from yolokit.accel.monitor import memory_in_use
from yolokit.accel.stop import GracefulStop, Interrupted
from yolokit.data import DetectionDataset, DetectionLoader, build_dataloader, to_device
from yolokit.models import Detector, create_model
from yolokit.train.autobatch import resolve_batch, training_probe, worst_case_boxes
from yolokit.train.callbacks import Callback
from yolokit.train.callbacks import call_hook as _call
from yolokit.train.checkpoint import atomic_save, rank_states, resolve_run, restore_run, resume_note, run_state
from yolokit.train.config import TrainConfig
from yolokit.train.ema import ModelEMA
from yolokit.train.evaluate import EvalResult, validate
from yolokit.train.freeze import freeze, freeze_prefixes, hold_frozen
from yolokit.train.meter import LossMeter
from yolokit.train.optim import LRSchedule, build_optimizer, resolve_optimizer
from yolokit.train.parts import build_datasets, build_loss, seed_everything
from yolokit.train.plan import RuntimePlan, runtime_plan, speed_settings, start_processes
from yolokit.train.scales import MultiScale
from yolokit.train.step import forward_backward
from yolokit.train.trackers import run_callbacks
from yolokit.train.weights import DEFAULT_MODEL, export_final, read_pretrained, transfer_weights


@dataclass
class Run:
    """Everything :meth:`Trainer.setup` builds for one training run."""

    cfg: TrainConfig
    plan: RuntimePlan                   # device, ranks, world, batch arithmetic: resolved once
    run_dir: Path
    callbacks: list[Callback]
    names: list[str]
    train_set: DetectionDataset
    loader: DetectionLoader
    val_loader: DetectionLoader
    model: Detector
    train_net: nn.Module
    criterion: nn.Module
    precision: Precision
    accumulator: Accumulator
    optimizer: torch.optim.Optimizer
    schedule: LRSchedule
    ema: ModelEMA | None
    channels_last: bool
    stop: GracefulStop
    frozen: list[str]                   # module prefixes held as they are (TrainConfig.freeze)
    scale: MultiScale                   # each optimizer step's input size (TrainConfig.multi_scale)
    start_epoch: int = 0
    start_step: int = 0                 # optimizer steps of start_epoch taken before a resume
    resume_meter: dict | None = None    # this rank's loss sums of those steps
    best: float = -1.0
    stale: int = 0
    steps: int = 0                      # optimizer steps taken in the run
    logged: int = 0                     # the step of the last on_log (0: none yet)
    step_in_epoch: int = 0              # optimizer steps completed in the current epoch
    meter: LossMeter | None = None      # the current epoch's loss sums
    result: EvalResult = field(default_factory=EvalResult)
    epoch_started: float = 0.0
    data_wait: float = 0.0              # seconds of this epoch the loop waited for the loader
    nonfinite: int = 0                  # this rank's non-finite losses in a row, as last read
    retries_synced: int = 0             # optimizer-step retries (any rank) the ranks have resynced after
    deadline: float = math.inf          # perf_counter() when the time budget runs out (TrainConfig.time)
    out_of_time: bool = False           # every rank agreed that it ran out
    done: int = 0                       # epochs completed and checkpointed

    device = property(lambda self: self.plan.device)
    main = property(lambda self: self.plan.main)

    def data_share(self) -> float:
        """Share of this epoch's training time so far spent waiting for data, in [0, 1]."""
        return self.data_wait / max(time.perf_counter() - self.epoch_started, 1e-9)


class Trainer:
    """Trains a detector as ``config`` says. ``fit()`` returns the final validation metrics."""

    def __init__(self, config: TrainConfig, *, callbacks: list[Callback] | None = None):
        self.config = config
        self.user_callbacks = list(callbacks or [])

    def fit(self) -> dict[str, Any]:
        run = self.setup()
        epoch = run.done = run.start_epoch
        try:
            with run.stop:                       # Ctrl-C / SIGTERM: stop at an optimizer step boundary
                for epoch in range(run.start_epoch, run.cfg.epochs):
                    losses = self.train_epoch(run, epoch)
                    mid_epoch = run.step_in_epoch < run.plan.steps_per_epoch
                    if run.out_of_time and mid_epoch:      # the time budget: validate, save this step
                        self._stop_in_epoch(run, epoch)
                        break
                    if self.end_epoch(run, epoch, losses) or run.out_of_time:
                        break
                if run.out_of_time:
                    _call(run.callbacks, "on_time_up", run.steps, run.run_dir, run.cfg.time,
                          run.result.as_dict() if mid_epoch else None)
            if run.main:                         # the final weights, before on_train_end (trackers send them)
                weights = export_final(run.ema.module if run.ema else run.model,
                                       run.run_dir / "weights" / "model.pt", run.names, run.cfg)
                _call(run.callbacks, "on_export", weights)
        except KeyboardInterrupt as exc:         # a second signal from here on ends the process at once
            stop = Interrupted.of(exc)
            run.accumulator.rewind()             # a partial step leaves no trace (gradients, BatchNorm stats)
            if run.done == epoch:                # mid-epoch: a checkpoint at the last completed step
                self._save_position(run, epoch)
            _call(run.callbacks, "on_interrupt", run.steps, run.run_dir)
            stop.reported = True                 # the callbacks said where it stopped
            raise stop from None
        finally:
            run.loader.close()                   # workers end now, not at interpreter exit
            run.val_loader.close()
            _call(run.callbacks, "on_train_end")
        distributed.teardown()
        return {**run.result.as_dict(), "fitness": run.result.fitness, "run_dir": str(run.run_dir)}

    # --- setup -----------------------------------------------------------------------------

    def setup(self) -> Run:
        """Processes, run folder, data, model, loss, and each accel piece where it acts."""
        procs = start_processes(self.config)     # device (made current), rank, local rank, world
        device, world, main = procs.device, procs.world, procs.main
        cfg, resume, run_dir = resolve_run(self.config)
        run_dir = distributed.broadcast_object(run_dir)
        seed_everything(cfg.seed + procs.rank)
        speed = speed_settings(cfg, device, procs.local_world)
        speed.apply()                            # CUDA: benchmark, TF32, fast kernels; CPU: deterministic
        callbacks = run_callbacks(run_dir, main=main, plots=cfg.plots, trackers=cfg.tracker, user=self.user_callbacks)
        notes: list[str] = []                    # lines for on_setup_end

        train_set, val_set = build_datasets(cfg, notes.append)   # every rank scans: none waits in a collective
        names = list(train_set.names.values()) if isinstance(train_set.names, dict) else list(train_set.names)

        # model and loss: pretrained weights bring their variant; every process starts from the main one's weights
        source = read_pretrained(cfg.weights, cfg.model) if cfg.weights and resume is None else None
        cfg = cfg.replace(model=cfg.model or (source.name if source is not None else DEFAULT_MODEL))
        model = create_model(cfg.model, num_classes=len(names))
        if source is not None:
            transfer_weights(model, source, path=cfg.weights, report=notes.append)
        frozen = freeze_prefixes(model, cfg.freeze)     # no gradient, no decay, BatchNorm statistics held
        if frozen:
            notes.append(f"frozen: {freeze(model, frozen):,} parameters of {', '.join(frozen)}")
        model.to(device)
        distributed.broadcast_module(model)
        criterion = build_loss(model, cfg)
        if cfg.checkpointing:
            enable_activation_checkpointing(model.checkpoint_units(cfg.checkpointing))
        channels_last = cfg.uses_channels_last(device.type)
        perf.prepare_model(model, channels_last=channels_last or None)
        precision = Precision(cfg.precision, device)

        ema = ModelEMA(model, cfg.ema_decay, cfg.ema_tau, frozen=frozen) if cfg.ema else None
        train_net = perf.prepare_model(model, compile=cfg.compile)

        # batch: the total over processes; "auto" probes the worst case once, the smallest fit over ranks
        sync_bn = cfg.uses_sync_bn(world, device.type)   # collectives in every forward and backward,
        scale = MultiScale(cfg.imgsz, int(max(model.strides)), cfg.seed, enabled=cfg.multi_scale)
        probe = training_probe(model, train_net, criterion, precision, device, imgsz=scale.largest, val_imgsz=cfg.imgsz,
                               max_boxes=worst_case_boxes(train_set, cfg), channels_last=channels_last,
                               state_tensors=1 if cfg.optimizer.lower() == "sgd" else 2, world=world, sync_bn=sync_bn)
        batch = resolve_batch(cfg, probe, device, resumed=resume, report=notes.append, world=world)
        if sync_bn:                                      # so equal micro-batch counts: no OOM split
            nn.SyncBatchNorm.convert_sync_batchnorm(model)
        # the runtime plan: per-rank batch, accumulation, steps per epoch, worked out here only
        plan = runtime_plan(procs, batch=batch, nominal_batch=cfg.nbs, train_size=len(train_set), whole_steps=sync_bn)
        accumulator = Accumulator(train_net, nominal_batch=cfg.nbs, batch_size=plan.per_rank, world_size=plan.world,
                                  reduction="sum", min_micro_batch=plan.per_rank if sync_bn else 1)
        ranks = dict(rank=plan.rank, world_size=plan.world)
        loader = build_dataloader(train_set, plan.per_rank, workers=speed.workers, shuffle=True, seed=cfg.seed,
                                  pin_memory=speed.pin_memory, uint8_images=True, accumulate=plan.accumulate,
                                  whole_steps=sync_bn, rect=cfg.rect, stride=scale.stride,
                                  hsv_on_device=speed.hsv_on_device, **ranks)
        val_loader = build_dataloader(val_set, plan.per_rank * 2, workers=speed.workers, shuffle=False, seed=cfg.seed,
                                      pin_memory=speed.pin_memory, uint8_images=True, **ranks)

        opt_name, lr0, momentum = resolve_optimizer(
            cfg.optimizer, cfg.lr0, cfg.momentum, num_classes=len(names),
            iterations=math.ceil(len(train_set) / max(batch, cfg.nbs)) * cfg.epochs)
        decay = cfg.weight_decay * plan.images_per_step / cfg.nbs
        optimizer = build_optimizer(model, opt_name, lr0, momentum, decay)
        schedule = LRSchedule(lr0, cfg.lrf, cfg.epochs, plan.steps_per_epoch, cfg.warmup_epochs,
                              cfg.warmup_momentum, cfg.warmup_bias_lr, momentum, cfg.cos_lr)
        run = Run(cfg, plan, run_dir, callbacks, names, train_set, loader, val_loader, model, train_net, criterion,
                  precision, accumulator, optimizer, schedule, ema, channels_last, GracefulStop(), frozen, scale)
        if resume is not None:
            restore_run(run, resume)
            notes.append(resume_note(run))
        if main:
            (run_dir / "weights").mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(cfg.to_yaml())
        _call(callbacks, "on_setup_end", dict(
            model=cfg.model, data=cfg.data, classes=len(names), world=world, device=str(device), batch=batch,
            per_process=plan.per_rank, accumulate=plan.accumulate, step_batch=plan.images_per_step,
            optimizer=opt_name, lr0=lr0, precision=precision.precision, layout=perf.describe(model),
            workers=speed.workers,
            sync_bn=sync_bn, config=cfg.to_yaml(), notes=notes))
        _call(callbacks, "on_train_start", run_dir, cfg.to_dict())
        run.deadline = time.perf_counter() + cfg.time * 3600 if cfg.time else math.inf
        return run

    # --- one epoch -------------------------------------------------------------------------

    def train_epoch(self, run: Run, epoch: int) -> dict[str, float]:
        """Forward / loss / backward of every batch, an optimizer step every ``accumulate`` batches."""
        cfg, acc = run.cfg, run.accumulator
        first = run.start_step if epoch == run.start_epoch else 0     # steps taken before a resume
        run.epoch_started, run.step_in_epoch = time.perf_counter(), first
        run.train_set.mosaic = epoch < cfg.epochs - cfg.close_mosaic   # Mosaic off for the last K
        run.loader.set_epoch(epoch, start_step=first)                  # their batches are not loaded again
        run.model.train()
        hold_frozen(run.model, run.frozen)                             # their BatchNorm statistics stay fixed
        _call(run.callbacks, "on_epoch_start", epoch, cfg.epochs, len(run.loader))
        run.meter = meter = LossMeter(run.device)
        run.nonfinite = 0
        if first and run.resume_meter:
            meter.load_state_dict(run.resume_meter)

        def micro_step(micro: dict, weight: float) -> tuple[dict[str, torch.Tensor], int]:
            data = to_device(micro, run.device, non_blocking=True)
            images, targets = run.scale(data["images"], data["targets"], epoch, run.step_in_epoch)  # multi_scale
            _, parts = forward_backward(run.train_net, run.criterion, run.precision, images, targets,
                                        max_boxes=micro["max_boxes"], weight=weight, channels_last=run.channels_last)
            return parts, len(images)    # weight = images: Ultralytics' loss * batch

        acc.start_epoch(len(run.loader), first_step=first, epoch_steps=run.plan.steps_per_epoch)
        run.data_wait, ready = 0.0, time.perf_counter()
        for i, batch in enumerate(run.loader):
            run.data_wait += time.perf_counter() - ready  # the host waited for data (no device sync)
            meter.add(acc.run(micro_step, batch))    # micro-batches; split and replayed on OOM
            if acc.should_step():                          # gradients summed over processes
                self._optimizer_step(run, epoch)
                if run.out_of_time:                        # the time budget: every rank stops here
                    break
            if meter.due(i):                               # the device is read every few batches only
                run.nonfinite = meter.longest_nonfinite_run()   # decided at a step boundary, by all ranks
                run.precision.check()                      # skipped steps (the same on every rank): warn, or stop
                if run.steps > run.logged:                 # trackers: at most once per optimizer step
                    run.logged, lr = run.steps, run.optimizer.param_groups[0]["lr"]
                    losses = {f"step/{k}": v for k, v in meter.take_recent().items()}
                    _call(run.callbacks, "on_log", run.steps, {**losses, "step/lr": lr})
            _call(run.callbacks, "on_batch_end", meter.running(), len(batch["indices"]),
                  memory_in_use(run.device) / 2**30, run.data_share())
            ready = time.perf_counter()
        while not run.out_of_time and acc.should_step():   # uneven shards: the other ranks' last steps
            self._optimizer_step(run, epoch)
        self._check_finite(run, max(distributed.all_gather_object(meter.longest_nonfinite_run())), epoch)
        run.precision.check()
        return meter.epoch_means()

    def _optimizer_step(self, run: Run, epoch: int) -> None:
        """Learning rate for this step, unscale / clip to norm 10 / step, zero, EMA; nothing read back.

        A step with inf/NaN gradients is skipped on the device (counted there, read by
        ``precision.check()``); the EMA is updated after every step, as in Ultralytics. A
        signal waits for the step's end; every ``save_period_iters`` steps ``last.pt`` is written.
        """
        with run.stop.deferred():
            run.schedule.apply(run.optimizer, epoch, epoch * run.schedule.iters_per_epoch + run.step_in_epoch)
            run.accumulator.step(
                run.optimizer, lambda: run.precision.step(run.optimizer, clip_grad_norm=10.0, blocking=False))
            run.optimizer.zero_grad(set_to_none=True)
            if run.ema is not None:
                run.ema.update(run.model)
            run.steps, run.step_in_epoch = run.steps + 1, run.step_in_epoch + 1
            run.meter.mark()                               # the loss sums of the completed steps
            if run.cfg.save_period_iters and run.steps % run.cfg.save_period_iters == 0:
                self._save_position(run, epoch)
        self._agree(run, epoch)

    def _agree(self, run: Run, epoch: int) -> None:
        """What every rank decides together at a step boundary (one exchange; see ``GracefulStop.requested``):
        a signal stops all, a loss that stays non-finite stops all, and after an optimizer step some
        rank retried on out-of-memory, all continue as rank 0 (``Accumulator.resync``)."""
        late = int(time.perf_counter() > run.deadline)
        if run.stop.requested(run.nonfinite, run.accumulator.step_retries, late):
            raise Interrupted(run.stop.received)
        nonfinite, retried, late = run.stop.agreed or (0, 0, 0)
        run.out_of_time = run.out_of_time or bool(late)
        self._check_finite(run, nonfinite, epoch)
        if retried > run.retries_synced:
            run.accumulator.resync(run.optimizer)
            run.retries_synced = retried

    def _stop_in_epoch(self, run: Run, epoch: int) -> None:
        """The time budget ran out mid-epoch: validate, and ``last.pt`` at this step (resume continues here)."""
        self._validate(run)
        self._save_position(run, epoch)

    @staticmethod
    def _validate(run: Run, keep_samples: int = 0) -> None:
        """The EMA weights (or the model's) on the whole val split, every rank its shard; into ``run.result``."""
        run.result, samples = validate(run.ema.module if run.ema else run.model, run.val_loader,
                                       num_classes=len(run.names), conf=run.cfg.conf, iou=run.cfg.iou,
                                       max_det=run.cfg.max_det, keep_samples=keep_samples)
        _call(run.callbacks, "on_validation_end", run.result, samples, run.names)

    def _save_position(self, run: Run, epoch: int) -> None:
        """``last.pt`` at the last completed optimizer step of ``epoch`` (a collective: every rank calls it)."""
        ranks = rank_states(run.meter)
        if run.main:
            atomic_save(run_state(run, epoch, {}, ranks, run.step_in_epoch), run.run_dir / "weights" / "last.pt")

    @staticmethod
    def _check_finite(run: Run, bad: int, epoch: int) -> None:
        if bad >= run.cfg.max_bad_steps:
            raise TrainingDiverged(
                f"loss was not finite for {bad} steps in a row in epoch {epoch + 1}; stopped. The last good "
                f"checkpoint is {run.run_dir / 'weights' / 'last.pt'}; try a lower lr0 or precision=fp32")

    # --- end of an epoch -------------------------------------------------------------------

    def end_epoch(self, run: Run, epoch: int, losses: dict[str, float]) -> bool:
        """Validate (every rank its shard), keep the best, write checkpoints and the results row.

        Returns:
            True when training should stop early (the same answer on every rank).
        """
        cfg, data_share = run.cfg, run.data_share()       # of the training loop, before validation
        last = epoch + 1 == cfg.epochs
        evaluated = (epoch + 1) % cfg.val_interval == 0 or last
        if evaluated:
            self._validate(run, keep_samples=16 if last and cfg.plots else 0)
        score = run.result.fitness
        improved = evaluated and score > run.best
        run.best, run.stale = (score, 0) if improved else (run.best, run.stale + int(evaluated))
        row = {"epoch": epoch + 1, **{f"train/{k}": v for k, v in losses.items()}, **run.result.as_dict(),
               "fitness": score, "lr": run.optimizer.param_groups[0]["lr"], "steps": run.steps,
               "seconds": time.perf_counter() - run.epoch_started, "data%": round(100 * data_share, 1)}
        ranks = rank_states()
        with run.stop.deferred():
            if run.main:
                state = run_state(run, epoch + 1, row, ranks)
                atomic_save(state, run.run_dir / "weights" / "last.pt")
                if improved:
                    atomic_save(state, run.run_dir / "weights" / "best.pt")
                if cfg.save_period and (epoch + 1) % cfg.save_period == 0:
                    atomic_save(state, run.run_dir / "weights" / f"epoch{epoch + 1}.pt")
            run.done = epoch + 1
        _call(run.callbacks, "on_epoch_end", row)
        stop = run.stale >= cfg.patience
        if stop:
            _call(run.callbacks, "on_early_stop", epoch, cfg.patience)
        self._agree(run, epoch)
        return stop


def _train_worker(config: TrainConfig) -> dict[str, Any]:
    return Trainer(config).fit()


def train(config: TrainConfig) -> dict[str, Any]:
    """Trains and returns the final metrics (of rank 0 when several processes train).

    Under torchrun every process calls this and trains as one rank of the group (the world
    comes from the environment). Otherwise ``config.devices`` > 1 starts that many local
    processes (:func:`yolokit.accel.launch.launch`).
    """
    if config.devices > 1 and distributed.world_size() == 1:
        from yolokit.accel.launch import launch
        return launch(_train_worker, config.devices, config)[0]
    return Trainer(config).fit()
