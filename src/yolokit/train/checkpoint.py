"""Atomic checkpoints that load with ``weights_only=True``, and what exact resume needs.

A checkpoint is written atomically (:func:`yolokit.train.files.atomic_save`): a crash or a
full disk at any point leaves either the old file or the new one, never half of one.

A training checkpoint (``weights/last.pt``) is written at the end of every epoch, every
``save_period_iters`` optimizer steps, and when training is interrupted (at the last
completed optimizer step). Its position is ``epoch`` (epochs completed) plus
``step_in_epoch`` (optimizer steps of the next epoch already taken); the sampler is
deterministic from (seed, epoch), so that count is all it takes to skip what was
consumed. ``ranks`` holds each process's own state: its RNG states and, mid-epoch, its
loss sums (:class:`yolokit.train.meter.LossMeter`), gathered when the checkpoint is written.
"""

from __future__ import annotations

import random
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from yolokit.accel import distributed
from yolokit.train.config import TrainConfig
from yolokit.train.files import SaveError, atomic_save
from yolokit.train.meter import LossMeter
from yolokit.train.optim import load_optimizer_state
from yolokit.train.state import Parts, Progress
from yolokit.train.weights import export_final


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Loads a checkpoint with ``weights_only=True``; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # corrupt file or disallowed content
        raise ValueError(f"cannot load checkpoint {path}: {exc}") from exc


def rng_states() -> dict[str, Any]:
    """Every global RNG state (python, numpy legacy, torch CPU, CUDA) in weights_only-safe types."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {
        "python": [version, list(internal), gauss_next],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_states(states: dict[str, Any]) -> None:
    """Restores the states captured by ``rng_states``."""
    version, internal, gauss_next = states["python"]
    random.setstate((version, tuple(internal), gauss_next))
    kind, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(states["torch"])
    if states.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class WeightsFolder:
    """A run's ``weights/``: ``last.pt`` (everything exact resume needs), ``best.pt`` (the weights
    only), ``epoch{N}.pt``. A failed save (a full disk) says which checkpoint is intact and the
    command that resumes from it."""

    def __init__(self, parts: Parts, progress: Progress) -> None:
        self.parts, self.folder = parts, parts.run_dir / "weights"
        self.progress = progress
        self.saved = (progress.epoch, progress.step_in_epoch) if progress.steps else None   # last.pt's position

    def save(self, state: dict[str, Any], name: str, *, weights_only: bool = False) -> None:
        """``state`` as ``<name>``, atomically; ``weights_only``: the inference file instead (float16 EMA
        weights, architecture, class names), where the model holds its architecture as data."""
        parts, path = self.parts, self.folder / name
        try:
            if weights_only and parts.model.config is not None:
                export_final(parts.ema.module if parts.ema else parts.model, path, list(parts.names), parts.config,
                             extra={"epoch": state["epoch"], "fitness": state["best_fitness"]})
            else:
                atomic_save(state, path)
        except SaveError as exc:
            exc.advice = self.advice()
            raise
        if name == "last.pt":
            self.saved = (self.progress.epoch, self.progress.step_in_epoch)

    def save_epoch(self, row: dict[str, Any], ranks: list[dict], *, improved: bool) -> None:
        """At an epoch's end, once ``progress`` counts it done: ``last.pt`` (with the results ``row``),
        ``best.pt`` when the fitness improved (the weights only, float16 EMA: last.pt is the one to resume),
        and ``epoch{N}.pt`` every ``save_period`` epochs. Only the main process writes."""
        if not self.parts.main:
            return
        state, epoch, every = run_state(self.parts, self.progress, row, ranks), self.progress.epoch, \
            self.parts.config.save_period
        self.save(state, "last.pt")
        if improved:
            self.save(state, "best.pt", weights_only=True)
        if every and epoch % every == 0:
            self.save(state, f"epoch{epoch}.pt")

    def save_position(self, meter: LossMeter | None) -> None:
        """``last.pt`` at the last completed optimizer step (mid-epoch: with each rank's loss sums). A
        collective: every rank calls it."""
        ranks = rank_states(meter)
        if self.parts.main:
            self.save(run_state(self.parts, self.progress, {}, ranks), "last.pt")

    def advice(self) -> str:
        """Which checkpoint is intact, and the command that resumes from it."""
        if self.saved is None:
            return "no checkpoint was written yet: free some space and start again"
        epoch, step = self.saved
        where = f"after epoch {epoch}" if not step else f"at step {step} of epoch {epoch + 1}"
        return (f"{self.folder / 'last.pt'} is intact ({where}); free some space and resume with: "
                f"yolokit train --resume {self.parts.run_dir}")


def resolve_run(config: TrainConfig) -> tuple[TrainConfig, dict[str, Any] | None, Path]:
    """(config, resume state, run folder) of a training run.

    ``resume`` a folder or a ``last.pt``: that run, with its saved config (``epochs`` may
    be raised; ``verbose`` is the resuming config's). ``resume="auto"``: the run folder is ``out``
    itself, never numbered, and the run resumes from ``out/weights/last.pt`` when there is one;
    so every (re)start of the same command, as torchrun's ``--max-restarts`` makes, finds the
    same folder. Otherwise a new run in ``out``, or ``out2``, ``out3``... when ``out`` holds a
    run already.
    """
    path = Path(config.out) / "weights" / "last.pt" if config.resume == "auto" else None
    if path is not None and not path.is_file():
        return config, None, Path(config.out)
    if config.resume:
        path = path or Path(config.resume)
        path = path / "weights" / "last.pt" if path.is_dir() else path
        state = load_checkpoint(path)
        saved = TrainConfig.from_dict({**state["train_config"], "resume": str(path)})
        epochs = max(config.epochs, saved.epochs) if config.epochs != TrainConfig.epochs else saved.epochs
        return saved.replace(epochs=epochs, verbose=config.verbose), state, path.parent.parent   # output: yours
    out = Path(config.out)
    run, n = out, 2
    while (run / "results.csv").exists() or (run / "weights").exists():
        run, n = out.with_name(f"{out.name}{n}"), n + 1
    return config, None, run


def rank_states(meter: LossMeter | None = None) -> list[dict[str, Any]]:
    """Every process's RNG states and loss sums (``meter.state_dict()``), in rank order.

    A collective: every rank calls it at the same point (the checkpoint's position).
    """
    return distributed.all_gather_object({"rng": rng_states(),
                                          "meter": meter.state_dict() if meter is not None else None})


def restore_rank_state(ranks: list[dict[str, Any]], *, rank: int, world: int) -> dict | None:
    """Restores this rank's RNG states from ``rank_states``'s list and returns its loss sums.

    With another number of processes than the checkpoint's, RNG states stay as seeded and
    rank 0 continues from the sums of all saved ranks (the epoch's means are over all ranks).
    """
    if len(ranks) == world:
        set_rng_states(ranks[rank]["rng"])
        return ranks[rank]["meter"]
    meters = [r["meter"] for r in ranks if r["meter"] and r["meter"]["keys"]]
    if rank or not meters:
        return None
    counts = torch.stack([m["counts"] for m in meters])
    return {"keys": meters[0]["keys"], "sums": sum(m["sums"] for m in meters),
            "counts": torch.cat([counts[:, :1].sum(0), counts[:, 1:].amax(0)])}


def run_state(parts: Parts, progress: Progress, metrics: dict, ranks: list[dict]) -> dict[str, Any]:
    """Everything exact resume needs at ``progress``'s position, in weights_only-loadable types.

    Args:
        parts: What the run built (model, EMA, optimizer, precision, accumulator, plan, config).
        progress: Where the run is (epochs completed, steps of the next epoch, best fitness...).
        metrics: The last results row (empty mid-epoch).
        ranks: ``rank_states()`` gathered at this position.
    """
    config = parts.model.config   # the architecture as data (None for a model given as an instance)
    return {
        **progress.state_dict(), "model": parts.model.state_dict(),
        "model_config": asdict(config) if config is not None else None, "names": list(parts.names),
        "ema": parts.ema.state_dict() if parts.ema else None, "optimizer": parts.optimizer.state_dict(),
        "precision": parts.precision.state_dict(), "accumulator": parts.accumulator.state_dict(),
        "batch": parts.plan.batch, "plan": parts.plan.as_dict(), "train_config": parts.config.to_dict(),
        "metrics": metrics, "ranks": ranks,
    }


def restore_run(parts: Parts, progress: Progress, state: dict[str, Any]) -> dict | None:
    """Loads ``run_state``'s checkpoint into ``parts`` and ``progress``; returns this rank's loss sums of the
    completed steps of the epoch in progress (None at an epoch boundary)."""
    parts.model.load_state_dict(state["model"])
    if parts.ema is not None and state.get("ema"):
        parts.ema.load_state_dict(state["ema"])
    load_optimizer_state(parts.optimizer, state["optimizer"])  # keeps this run's fused/foreach choice
    parts.precision.load_state_dict(state["precision"])
    parts.accumulator.load_state_dict(state.get("accumulator", {}))
    progress.load_state_dict(state)
    return restore_rank_state(state["ranks"], rank=parts.plan.rank, world=parts.plan.world)
