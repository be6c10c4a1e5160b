"""Atomic checkpoints that load with ``weights_only=True``, and what exact resume needs.

A checkpoint is written to a temporary file in the target folder, flushed and fsynced,
then renamed over the target: a crash at any point leaves either the old file or the
new one, never half of one.

A training checkpoint (``weights/last.pt``) is written at the end of every epoch, every
``save_period_iters`` optimizer steps, and when training is interrupted (at the last
completed optimizer step). Its position is ``epoch`` (epochs completed) plus
``step_in_epoch`` (optimizer steps of the next epoch already taken); the sampler is
deterministic from (seed, epoch), so that count is all it takes to skip what was
consumed. ``ranks`` holds each process's own state: its RNG states and, mid-epoch, its
loss sums (:class:`yolokit.train.meter.LossMeter`), gathered when the checkpoint is written.
"""

from __future__ import annotations

import os
import random
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from yolokit.accel import distributed
from yolokit.train.config import TrainConfig
from yolokit.train.evaluate import EvalResult
from yolokit.train.optim import load_optimizer_state


def atomic_save(obj: Any, path: str | Path) -> Path:
    """``torch.save`` to ``path`` atomically (temporary file, fsync, rename, fsync folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:  # some platforms cannot open folders
        return path
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


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


def resolve_run(config: TrainConfig) -> tuple[TrainConfig, dict[str, Any] | None, Path]:
    """(config, resume state, run folder) of a training run.

    ``resume`` a folder or a ``last.pt``: that run, with its saved config (``epochs`` may
    be raised). ``resume="auto"``: the run folder is ``out`` itself, never numbered, and the
    run resumes from ``out/weights/last.pt`` when there is one; so every (re)start of the same
    command, as torchrun's ``--max-restarts`` makes, finds the same folder. Otherwise a new
    run in ``out``, or ``out2``, ``out3``... when ``out`` holds a run already.
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
        return saved.replace(epochs=epochs), state, path.parent.parent
    out = Path(config.out)
    run, n = out, 2
    while (run / "results.csv").exists() or (run / "weights").exists():
        run, n = out.with_name(f"{out.name}{n}"), n + 1
    return config, None, run


def rank_states(meter: Any = None) -> list[dict[str, Any]]:
    """Every process's RNG states and loss sums (``meter.state_dict()``), in rank order.

    A collective: every rank calls it at the same point (the checkpoint's position).
    """
    return distributed.all_gather_object({"rng": rng_states(),
                                          "meter": meter.state_dict() if meter is not None else None})


def restore_rank_state(ranks: list[dict[str, Any]]) -> dict | None:
    """Restores this rank's RNG states from ``rank_states``'s list and returns its loss sums.

    With another number of processes than the checkpoint's, RNG states stay as seeded and
    rank 0 continues from the sums of all saved ranks (the epoch's means are over all ranks).
    """
    rank, world = distributed.rank(), distributed.world_size()
    if len(ranks) == world:
        set_rng_states(ranks[rank]["rng"])
        return ranks[rank]["meter"]
    meters = [r["meter"] for r in ranks if r["meter"] and r["meter"]["keys"]]
    if rank or not meters:
        return None
    counts = torch.stack([m["counts"] for m in meters])
    return {"keys": meters[0]["keys"], "sums": sum(m["sums"] for m in meters),
            "counts": torch.cat([counts[:, :1].sum(0), counts[:, 1:].amax(0)])}


def run_state(run: Any, epoch: int, metrics: dict, ranks: list[dict], step_in_epoch: int = 0) -> dict[str, Any]:
    """Everything exact resume needs, in weights_only-loadable types.

    Args:
        run: The trainer's ``Run``.
        epoch: Epochs completed.
        metrics: The last results row (empty mid-epoch).
        ranks: ``rank_states()`` gathered at this position.
        step_in_epoch: Optimizer steps of epoch ``epoch`` (0-based) already taken.
    """
    return {
        "epoch": epoch, "step_in_epoch": step_in_epoch, "model": run.model.state_dict(),
        "model_config": asdict(run.model.config), "ema": run.ema.state_dict() if run.ema else None,
        "optimizer": run.optimizer.state_dict(), "precision": run.precision.state_dict(),
        "accumulator": run.accumulator.state_dict(), "batch": run.plan.batch, "plan": run.plan.as_dict(),
        "steps": run.steps,
        "best_fitness": run.best, "stale": run.stale, "train_config": run.cfg.to_dict(), "metrics": metrics,
        "result": run.result.as_dict(), "ranks": ranks,
    }


def restore_run(run: Any, state: dict[str, Any]) -> None:
    """Loads ``run_state``'s checkpoint into the trainer's ``Run`` (this rank's part of ``ranks``)."""
    run.model.load_state_dict(state["model"])
    if run.ema is not None and state.get("ema"):
        run.ema.load_state_dict(state["ema"])
    load_optimizer_state(run.optimizer, state["optimizer"])  # keeps this run's fused/foreach choice
    run.precision.load_state_dict(state["precision"])
    run.accumulator.load_state_dict(state.get("accumulator", {}))
    run.resume_meter = restore_rank_state(state["ranks"])
    run.start_epoch, run.start_step = int(state["epoch"]), int(state["step_in_epoch"])
    run.best, run.stale, run.steps = float(state["best_fitness"]), int(state["stale"]), int(state["steps"])
    run.logged = run.steps          # trackers log the steps after these
    last = state.get("result", {})  # the last validation's headline numbers: rows of epochs without one repeat them
    run.result = EvalResult(precision=last.get("precision", 0.0), recall=last.get("recall", 0.0),
                            map50=last.get("mAP50", 0.0), map50_95=last.get("mAP50-95", 0.0))


def resume_note(run: Any) -> str:
    """Where a resumed run continues, and what is not exact about it."""
    if not run.start_step:
        return f"resuming after epoch {run.start_epoch}"
    note = f"resuming at optimizer step {run.start_step} of epoch {run.start_epoch + 1}"
    if run.train_set.buffer_size:
        note += (" (mosaic_buffer > 0: the rest of this epoch draws Mosaic partners from a buffer that starts "
                 "empty here, so it differs from an uninterrupted run; later epochs do not)")
    return note
