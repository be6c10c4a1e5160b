"""A run's state in two objects: :class:`Parts`, what setup builds, and :class:`Progress`, where the run is.

``Parts`` is frozen: the loaders, the model, the optimizer and the rest are built once by
:meth:`yolokit.train.Trainer.setup` and only their contents change. ``Progress`` is the
handful of counters that change as training goes, with its own ``state_dict()``: a
checkpoint holds it beside the parts' own states (:mod:`yolokit.train.checkpoint`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from yolokit.accel import Accumulator, GracefulStop, Precision, RankExchange, Watchdog
from yolokit.accel.graphs import StepGraphs
from yolokit.data import DetectionDataset, DetectionLoader
from yolokit.models import Detector
from yolokit.train.callbacks import Callback
from yolokit.train.config import TrainConfig
from yolokit.train.ema import ModelEMA
from yolokit.train.optim import LRSchedule
from yolokit.train.plan import DeviceSettings, RuntimePlan
from yolokit.train.scales import MultiScale
from yolokit.val import EvalResult


@dataclass(frozen=True)
class StepVotes:
    """What every rank decides together at each step boundary (the max over ranks; ``RankExchange``)."""

    signal: int = 0          # a Ctrl-C / SIGTERM some rank received: every rank stops
    bad_losses: int = 0      # the longest run of non-finite losses: the watchdog may stop every rank
    skipped_steps: int = 0   # the longest run of steps skipped for inf/NaN gradients: likewise
    step_retries: int = 0    # optimizer steps retried after out of memory: every rank continues as rank 0
    out_of_time: int = 0     # the time budget (TrainConfig.time) ran out: every rank stops here


@dataclass(frozen=True)
class Parts:
    """Everything :meth:`yolokit.train.Trainer.setup` builds for one run (fixed for the run)."""

    config: TrainConfig
    plan: RuntimePlan                   # device, ranks, world, batch arithmetic: resolved once
    settings: DeviceSettings            # what the device decides: precision, layout, kernels, workers
    run_dir: Path
    callbacks: tuple[Callback, ...]
    names: tuple[str, ...]              # class names
    train_set: DetectionDataset
    loader: DetectionLoader
    val_loader: DetectionLoader
    model: Detector                     # the model whose weights are saved
    train_net: nn.Module                # what the step runs: the model, or its compiled form
    criterion: nn.Module
    precision: Precision
    accumulator: Accumulator
    optimizer: torch.optim.Optimizer
    schedule: LRSchedule
    ema: ModelEMA | None
    frozen: tuple[str, ...]             # module prefixes held as they are (TrainConfig.freeze)
    scale: MultiScale                   # each optimizer step's input size (TrainConfig.multi_scale)
    watchdog: Watchdog                  # stops a diverged run (TrainConfig.max_bad_steps)
    stop: GracefulStop                  # Ctrl-C / SIGTERM at a step boundary
    exchange: RankExchange[StepVotes]   # the ranks' per-step agreement
    graphs: StepGraphs | None = None    # the step recorded as CUDA graphs (TrainConfig.cuda_graphs)
    data_check: bool = False            # several processes on a remote store: agree on the data each step

    @property
    def main(self) -> bool:
        """Whether this is the process that logs and saves (global rank 0)."""
        return self.plan.main


@dataclass
class Progress:
    """Where a run is: what changes as it trains, saved in its checkpoints.

    ``epoch`` counts the epochs completed (the epoch in progress, 0-based) and
    ``step_in_epoch`` the optimizer steps of that epoch completed; a checkpoint written at
    an epoch's end holds ``(epoch + 1, 0)``.
    """

    epoch: int = 0
    step_in_epoch: int = 0
    steps: int = 0                      # optimizer steps of the run
    best: float = -1.0                  # the best fitness so far
    stale: int = 0                      # validations since it improved
    logged: int = 0                     # the step of the last on_log (0: none yet)
    result: EvalResult = field(default_factory=EvalResult)   # the last validation

    def iteration(self, steps_per_epoch: int) -> int:
        """The optimizer step in progress, counted from the run's start (the learning-rate schedule's clock)."""
        return self.epoch * steps_per_epoch + self.step_in_epoch

    def step_taken(self) -> None:
        """One more optimizer step completed."""
        self.steps += 1
        self.step_in_epoch += 1

    def epoch_done(self) -> None:
        """The epoch in progress completed (validated and checkpointed)."""
        self.epoch += 1
        self.step_in_epoch = 0

    def validated(self, result: EvalResult) -> bool:
        """Record a validation; returns whether its fitness is the best so far."""
        self.result = result
        improved = result.fitness > self.best
        self.best, self.stale = (result.fitness, 0) if improved else (self.best, self.stale + 1)
        return improved

    def state_dict(self) -> dict[str, Any]:
        """The counters in a checkpoint's keys (``best_fitness``, the last validation's headline numbers)."""
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "steps": self.steps,
                "best_fitness": self.best, "stale": self.stale, "result": self.result.as_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.step_in_epoch = int(state["epoch"]), int(state["step_in_epoch"])
        self.best, self.stale, self.steps = float(state["best_fitness"]), int(state["stale"]), int(state["steps"])
        self.logged = self.steps            # trackers log the steps after these
        last = state.get("result", {})      # rows of epochs without a validation repeat these
        self.result = EvalResult(precision=last.get("precision", 0.0), recall=last.get("recall", 0.0),
                                 map50=last.get("mAP50", 0.0), map50_95=last.get("mAP50-95", 0.0),
                                 mask_map50=last.get("mask_mAP50"), mask_map50_95=last.get("mask_mAP50-95"),
                                 mask_precision=last.get("mask_precision"), mask_recall=last.get("mask_recall"))
