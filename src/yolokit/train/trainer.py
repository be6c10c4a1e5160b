"""The training loop, composed in plain sight.

``Trainer(config).fit()`` is three parts, each readable on its own: :meth:`Trainer.setup`
builds the run (:func:`yolokit.train.build.build_run`: processes, data, model, loss and each
``accel`` piece at the line where it acts); :meth:`Trainer.train_epoch` runs every loader
batch through :func:`yolokit.train.step.train_step`, the one step with each accel action on
its own line (the same pieces ``examples/custom_loop.py`` composes); :meth:`Trainer.end_epoch`
validates, checkpoints and reports. What a step means on any number of processes is said in
:mod:`yolokit.train.step`.

Resume is exact at any optimizer step (see :mod:`yolokit.train.checkpoint`): ``last.pt``
is written at epoch ends, every ``save_period_iters`` steps, and on Ctrl-C / SIGTERM at
the last completed step; :meth:`Trainer.close` ends the workers and tells the callbacks (a second
Ctrl-C waits for it). ``fit()`` leaves the process as it found it (:mod:`yolokit.train.process_state`);
``train(config)`` (:mod:`yolokit.train.entry`) starts the processes and makes a stop one line.
"""

from __future__ import annotations

import math
import time
from typing import Any

from yolokit.accel import Interrupted, distributed
from yolokit.accel.devices import DeviceFailure, is_device_error
from yolokit.accel.monitor import memory_in_use
from yolokit.accel.oom import resync
from yolokit.accel.stop import deferred_signals
from yolokit.data.store.remote import StoreError, StoreStopped
from yolokit.models import Detector
from yolokit.train.build import build_run
from yolokit.train.callbacks import Callback
from yolokit.train.callbacks import call_hook as _call
from yolokit.train.checkpoint import WeightsFolder, rank_states
from yolokit.train.config import TrainConfig
from yolokit.train.feeding import DataWait, EpochMonitor
from yolokit.train.files import SaveError
from yolokit.train.freeze import hold_frozen
from yolokit.train.incidents import BatchTrail, diverged_where, lost_images, store_stopped
from yolokit.train.meter import LossMeter
from yolokit.train.process_state import left_as_found
from yolokit.train.state import Parts, Progress, StepVotes
from yolokit.train.step import loader_batches, train_step
from yolokit.train.weights import export_final
from yolokit.val import EvalResult, validate


class Trainer:
    """Trains a detector as ``config`` says. ``fit()`` returns the final validation metrics.

    After :meth:`setup`: ``parts`` (what the run built, :class:`~yolokit.train.state.Parts`) and
    ``progress`` (where it is, :class:`~yolokit.train.state.Progress`).
    """

    parts: Parts
    progress: Progress

    def __init__(self, config: TrainConfig, *, callbacks: list[Callback] | None = None,
                 model: Detector | None = None):
        self.config, self.model = config, model   # model: any Detector of yours, trained instead of config.model
        self.user_callbacks = list(callbacks or [])

    def fit(self) -> dict[str, Any]:
        with left_as_found():                    # generators, kernels, threads, handlers: as before the run
            self.setup()
            try:
                return self.run()
            finally:
                self.close()

    def run(self) -> dict[str, Any]:
        """The epochs, from where :meth:`setup` left the run; the final metrics."""
        parts, progress = self.parts, self.progress
        epoch = progress.epoch
        try:
            with parts.stop, parts.exchange:     # Ctrl-C / SIGTERM: stop at an optimizer step boundary
                for epoch in range(progress.epoch, parts.config.epochs):
                    losses = self.train_epoch(epoch)
                    mid_epoch = progress.step_in_epoch < parts.plan.steps_per_epoch
                    if self.out_of_time and mid_epoch:     # the time budget: validate, save this step
                        progress.result = self.validate()
                        self.weights.save_position(self.meter)
                        break
                    if self.end_epoch(epoch, losses) or self.out_of_time:
                        break
                if self.out_of_time:
                    _call(parts.callbacks, "on_time_up", progress.steps, parts.run_dir, parts.config.time,
                          progress.result.as_dict() if mid_epoch else None)
            if parts.main and parts.model.config is not None:   # the final weights (trackers send them)
                weights = export_final(parts.ema.module if parts.ema else parts.model,
                                       parts.run_dir / "weights" / "model.pt", list(parts.names), parts.config)
                _call(parts.callbacks, "on_export", weights)
        except KeyboardInterrupt as exc:         # a second signal from here on ends the process at once
            stop = Interrupted.of(exc)
            parts.accumulator.rewind()           # a partial step leaves no trace (gradients, BatchNorm stats)
            if progress.epoch == epoch:          # mid-epoch: a checkpoint at the last completed step
                self.weights.save_position(self.meter)
            stop.run_dir, stop.steps = str(parts.run_dir), progress.steps   # what last.pt holds now
            _call(parts.callbacks, "on_interrupt", progress.steps, parts.run_dir)
            stop.reported = True                 # the callbacks said where it stopped
            raise stop from None
        except StoreError as exc:                # the object store stopped answering: one line, exit 1
            parts.accumulator.rewind()           # several processes: saved when all stopped at one step
            saved = progress.epoch == epoch and (parts.plan.world == 1 or isinstance(exc, StoreStopped))
            if saved:
                self.weights.save_position(self.meter)
                distributed.barrier()            # last.pt written before any rank exits (the launcher then
            raise store_stopped(exc, parts.run_dir, progress.steps if saved else None) from None   # stops all)
        except SaveError as exc:                 # a full disk: what is intact, and how to go on
            exc.advice = exc.advice or self.weights.advice()
            raise
        except Exception as exc:                 # a CUDA error: say where, with which files, before unwinding
            if not is_device_error(exc) or isinstance(exc, DeviceFailure):
                raise
            raise self.trail.device_failure(exc, len(parts.loader), parts.run_dir) from exc
        distributed.teardown()
        result = progress.result
        return {**result.as_dict(), "fitness": result.fitness, "run_dir": str(parts.run_dir)}

    def close(self) -> None:
        """Ends what the run started, however it ended: the loaders' workers now (not at interpreter exit),
        the monitor's thread, then ``on_train_end``. A Ctrl-C meanwhile waits until all of it is done."""
        parts = self.parts
        with deferred_signals():
            parts.loader.close()
            parts.val_loader.close()
            if self.monitor is not None:
                self.monitor.close()
            _call(parts.callbacks, "on_train_end")

    def setup(self) -> Parts:
        """Builds the run (:func:`yolokit.train.build.build_run`) and tells the callbacks."""
        built = build_run(self.config, user_callbacks=self.user_callbacks, model=self.model)
        self.parts, self.progress, self.resume_meter = built.parts, built.progress, built.resume_meter
        self.out_of_time, self.retries_synced = False, 0
        self.trail = BatchTrail()            # the last two batches' files: named if the device fails
        self.weights = WeightsFolder(self.parts, self.progress)
        self.data_wait = DataWait()
        self.monitor = EpochMonitor(self.parts.plan.device) if self.parts.settings.monitor else None
        _call(self.parts.callbacks, "on_setup_end", built.summary)
        _call(self.parts.callbacks, "on_train_start", self.parts.run_dir, self.parts.config.to_dict())
        hours = self.parts.config.time
        self.deadline = time.perf_counter() + hours * 3600 if hours else math.inf
        return self.parts

    # --- one epoch -------------------------------------------------------------------------

    def train_epoch(self, epoch: int) -> dict[str, float]:
        """Every loader batch of this rank through :func:`train_step`; returns the epoch's mean losses."""
        parts, progress, cfg = self.parts, self.progress, self.parts.config
        first = progress.step_in_epoch                                  # steps taken before a resume
        parts.train_set.mosaic = epoch < cfg.epochs - cfg.close_mosaic  # Mosaic off for the last K
        parts.loader.set_epoch(epoch, start_step=first)                 # their batches are not loaded again
        if hasattr(parts.criterion, "set_epoch"):                       # YOLO26: the branches' weights
            parts.criterion.set_epoch(epoch, cfg.epochs)
        parts.model.train()
        hold_frozen(parts.model, list(parts.frozen))                    # their BatchNorm statistics stay fixed
        _call(parts.callbacks, "on_epoch_start", epoch, cfg.epochs, len(parts.loader))
        self.meter = meter = LossMeter(parts.plan.device, world_size=parts.plan.world)
        if first and self.resume_meter:
            meter.load_state_dict(self.resume_meter)
        self.bad_losses = self.skipped_steps = 0                        # as last read from the device
        parts.accumulator.start_epoch(len(parts.loader), epoch_steps=parts.plan.steps_per_epoch, first_step=first)
        if self.monitor is not None:                                    # the device's readings, off this thread
            self.monitor.start()
        self.data_wait.start()
        for i, batch in enumerate(loader_batches(parts)):
            self.data_wait.got_batch()                                  # the host waited for data (no device sync)
            self.trail.add(epoch, i, progress.steps, batch)
            if train_step(parts, progress, meter, batch, epoch):
                self.after_step(epoch)
                if self.out_of_time:                                    # the time budget: every rank stops here
                    break
            if meter.due(i):                                            # the device is read every few batches
                self.read_meter()
            _call(parts.callbacks, "on_batch_end", meter.running(), len(batch["indices"]),
                  memory_in_use(parts.plan.device) / 2**30, self.data_wait.share())
            self.data_wait.ask()
        while not self.out_of_time and train_step(parts, progress, meter, None, epoch):   # uneven shards:
            self.after_step(epoch)                                                        # the others' last steps
        bad = max(distributed.all_gather_object(meter.longest_nonfinite_run()))
        parts.watchdog.check(bad_losses=bad, skipped_steps=parts.precision.check(),
                             **diverged_where(parts.run_dir, epoch))
        return meter.epoch_means()

    def read_meter(self) -> None:
        """The loss sums and skipped-step counts, read from the device; the step's losses to ``on_log``."""
        parts, progress = self.parts, self.progress
        self.bad_losses = self.meter.longest_nonfinite_run()            # decided at a step boundary, by all ranks
        self.skipped_steps = parts.precision.check()                    # the same on every rank
        if progress.steps > progress.logged:                            # trackers: at most once per optimizer step
            progress.logged = progress.steps
            values = {f"step/{k}": v for k, v in self.meter.take_recent().items()}
            values["step/lr"] = parts.optimizer.param_groups[0]["lr"]
            _call(parts.callbacks, "on_log", progress.steps, values)

    def after_step(self, epoch: int) -> None:
        """At an optimizer step boundary: the periodic checkpoint, then what every rank decides together."""
        every = self.parts.config.save_period_iters
        if every and self.progress.steps % every == 0:
            with self.parts.stop.deferred():
                self.weights.save_position(self.meter)
        self.agree(epoch)

    def agree(self, epoch: int) -> None:
        """The ranks' per-step exchange (:class:`yolokit.accel.RankExchange`) and what follows from it: a
        signal stops all, the watchdog may stop all, the time budget ends the run here, and after a step
        some rank retried on out of memory all continue as rank 0."""
        parts = self.parts
        votes = parts.exchange(StepVotes(
            signal=parts.stop.received or 0, bad_losses=self.bad_losses, skipped_steps=self.skipped_steps,
            step_retries=parts.accumulator.step_retries, out_of_time=int(time.perf_counter() > self.deadline)))
        if votes.signal:
            raise Interrupted(votes.signal)
        parts.watchdog.check(bad_losses=votes.bad_losses, skipped_steps=votes.skipped_steps,
                             **diverged_where(parts.run_dir, epoch))
        self.out_of_time = self.out_of_time or bool(votes.out_of_time)
        if votes.step_retries > self.retries_synced:
            resync(parts.accumulator, parts.optimizer)
            self.retries_synced = votes.step_retries

    # --- end of an epoch -------------------------------------------------------------------

    def validate(self, keep_samples: int = 0) -> EvalResult:
        """The EMA weights (or the model's) on the whole val split, every rank its shard."""
        parts, cfg = self.parts, self.parts.config
        result, samples = validate(parts.ema.module if parts.ema else parts.model, parts.val_loader,
                                   num_classes=len(parts.names), conf=cfg.conf, iou=cfg.iou, max_det=cfg.max_det,
                                   keep_samples=keep_samples, world_size=parts.plan.world)
        _call(parts.callbacks, "on_validation_end", result, samples, list(parts.names))
        return result

    def end_epoch(self, epoch: int, losses: dict[str, float]) -> bool:
        """Validate (every rank its shard), keep the best, write checkpoints and the results row.

        Returns:
            True when training should stop early (the same answer on every rank).
        """
        parts, progress, cfg = self.parts, self.progress, self.parts.config
        data_share = self.data_wait.share()                  # of the training loop, before validation
        knobs = f"{parts.settings.workers} workers, cache {cfg.cache}, augment_on {parts.settings.augment_on}"
        device = self.monitor.stop(epoch, data_share, knobs) if self.monitor is not None else {}
        last = epoch + 1 == cfg.epochs
        evaluated = (epoch + 1) % cfg.val_interval == 0 or last
        with self.trail.validating():
            improved = evaluated and progress.validated(self.validate(keep_samples=16 if last and cfg.plots else 0))
        row = {"epoch": epoch + 1, **{f"train/{k}": v for k, v in losses.items()}, **progress.result.as_dict(),
               "fitness": progress.result.fitness, "lr": parts.optimizer.param_groups[0]["lr"],
               "steps": progress.steps, "seconds": self.data_wait.seconds(), "data%": round(100 * data_share, 1),
               **device, **lost_images([parts.train_set, parts.val_loader.dataset])}
        ranks = rank_states()
        with parts.stop.deferred():
            progress.epoch_done()
            self.weights.save_epoch(row, ranks, improved=improved)
            _call(parts.callbacks, "on_epoch_end", row)   # results.csv's row: a Ctrl-C waits for it too
        stop = progress.stale >= cfg.patience
        if stop:
            _call(parts.callbacks, "on_early_stop", epoch, cfg.patience)
        self.agree(epoch)
        return stop
