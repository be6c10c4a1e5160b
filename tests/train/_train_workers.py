"""Functions run in processes started by ``launch`` for the distributed training tests.

Kept out of the test files so spawned children import a plain module by name.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import os
import random
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from yolokit.accel import distributed
from yolokit.data import DetectionDataset, build_dataloader
from yolokit.train import TrainConfig, Trainer, autobatch
from yolokit.train.callbacks import Callback
from yolokit.train.checkpoint import load_checkpoint
from yolokit.train.process_state import ProcessState
from yolokit.val import validate

TIMEOUT_S = 60.0


def _digest(model: torch.nn.Module) -> str:
    """Bits of every parameter and buffer."""
    h = hashlib.sha1()
    for t in [*model.parameters(), *model.buffers()]:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def fit_recording(config: TrainConfig, model: torch.nn.Module | None = None) -> dict:
    """``Trainer(config, model=model).fit()``, recording a digest of the weights after every optimizer step."""
    digests: list[str] = []
    original = Trainer.after_step

    def recording(self, epoch):
        original(self, epoch)
        digests.append(_digest(self.parts.model))

    Trainer.after_step = recording
    try:
        result = Trainer(config, model=model).fit()
    finally:
        Trainer.after_step = original
    return {"result": result, "digests": digests, "rank": distributed.rank()}


def fit_recording_sizes(config: TrainConfig) -> dict:
    """``Trainer(config).fit()``, recording the (H, W) of every micro-batch the network gets, step by step
    (a step in which this rank had no micro-batch is an empty list)."""
    import yolokit.train.step as step_module

    steps: list[list[tuple[int, int]]] = [[]]
    forward_backward, after_step = step_module.forward_backward, Trainer.after_step

    def fed(net, criterion, precision, images, targets, **kw):
        steps[-1].append(tuple(images.shape[-2:]))
        return forward_backward(net, criterion, precision, images, targets, **kw)

    def stepped(self, epoch):
        after_step(self, epoch)
        steps.append([])

    step_module.forward_backward, Trainer.after_step = fed, stepped
    try:
        Trainer(config).fit()
    finally:
        step_module.forward_backward, Trainer.after_step = forward_backward, after_step
    return {"rank": distributed.rank(), "steps": steps[:-1]}


def fit_recording_images(config: TrainConfig) -> dict:
    """``Trainer(config).fit()``, recording the dataset indices of every micro-batch this rank trains on, step by
    step (a step in which this rank had no micro-batch is an empty list), and the weights' digest after each."""
    import yolokit.train.trainer as trainer_module

    steps: list[list[int]] = [[]]
    digests: list[str] = []
    train_step, after_step = trainer_module.train_step, Trainer.after_step

    def fed(parts, progress, meter, batch, epoch):
        if batch is not None:
            steps[-1].extend(int(i) for i in batch["indices"])
        return train_step(parts, progress, meter, batch, epoch)

    def stepped(self, epoch):
        after_step(self, epoch)
        digests.append(_digest(self.parts.model))
        steps.append([])

    trainer_module.train_step, Trainer.after_step = fed, stepped
    try:
        result = Trainer(config).fit()
    finally:
        trainer_module.train_step, Trainer.after_step = train_step, after_step
    return {"rank": distributed.rank(), "steps": steps[:-1], "digests": digests, "result": result}


def fit_where_one_rank_diverges(config: TrainConfig) -> dict:
    """Rank 1's loss is NaN from its first batch on, rank 0's never: both must stop, at the same step."""
    from yolokit.accel import TrainingDiverged
    from yolokit.losses import YOLOv8Loss

    original = YOLOv8Loss.forward
    if distributed.rank() == 1:
        def nan(self, maps, targets, max_boxes=None):
            total, parts = original(self, maps, targets, max_boxes=max_boxes)
            return total * float("nan"), {k: v * float("nan") for k, v in parts.items()}
        YOLOv8Loss.forward = nan
    stopped_at = []
    agree = Trainer.agree

    def recording(self, epoch):
        try:
            agree(self, epoch)
        except TrainingDiverged:
            stopped_at.append(self.progress.steps)
            raise

    Trainer.agree = recording
    try:
        Trainer(config).fit()
    except TrainingDiverged as exc:
        return {"rank": distributed.rank(), "steps": stopped_at, "message": str(exc)}
    finally:
        Trainer.agree = agree
        YOLOv8Loss.forward = original
    return {"rank": distributed.rank(), "steps": stopped_at, "message": None}


def fit_with_measured_batch(config: TrainConfig, per_rank: list[int] | None) -> dict:
    """Training with ``batch="auto"`` where rank r measures ``per_rank[r]`` (None: measuring fails)."""
    def measure(*args, **kwargs):
        if per_rank is None:
            raise AssertionError("batch auto was measured again on resume")
        return per_rank[distributed.rank()]

    autobatch.measure_batch = measure
    result = Trainer(config).fit()
    return {"result": result, "rank": distributed.rank()}


def validate_shard(data: str, weights: str, batch: int, imgsz: int) -> dict:
    """Distributed validation of the EMA weights in a run's checkpoint, each rank its shard."""
    distributed.setup(timeout=TIMEOUT_S)
    model, names = load_ema(weights)
    val = DetectionDataset(data, "val", imgsz=imgsz, rect=True)
    loader = build_dataloader(val, batch, workers=0, shuffle=False)
    result, _ = validate(model, loader, num_classes=len(names))
    out = {"stats": result.stats.tolist(), "batches": len(loader), "per_class": result.per_class_ap.tolist(),
           "images": sum(len(b["indices"]) for b in loader)}
    distributed.teardown()
    return out


def load_ema(path: str) -> tuple[torch.nn.Module, list[str]]:
    """The EMA model of a training checkpoint."""
    from yolokit.models import create_model

    state = load_checkpoint(Path(path))
    config = state["model_config"]
    model = create_model(config["name"], num_classes=config["num_classes"])
    model.load_state_dict(state["ema"]["module"])
    return model.eval(), [str(i) for i in range(config["num_classes"])]


class _CrashAt(Callback):
    """Ends the run after loader batch ``at`` (counted over the run): ``how`` is "crash" (an
    exception, leaving the files as a killed process leaves them) or the name of a signal sent
    to this process ("SIGINT", "SIGTERM"); on rank ``rank`` only (None: every rank)."""

    all_ranks = True        # a user callback runs on rank 0 only, unless it says so

    def __init__(self, at: int, how: str, rank: int | None = None):
        self.at, self.how, self.rank, self.seen = at, how, rank, 0

    def on_batch_end(self, losses, images, memory_gb, data_share):
        self.seen += 1
        if self.seen != self.at or self.rank not in (None, distributed.rank()):
            return
        if self.how == "crash":
            raise RuntimeError("simulated crash")
        os.kill(os.getpid(), getattr(signal, self.how))


def rng_digest() -> str:
    """Bits of this process's python, numpy and torch RNG states."""
    h = hashlib.sha1()
    h.update(repr(random.getstate()).encode())
    h.update(repr(np.random.get_state()[1].tolist()).encode())
    h.update(torch.get_rng_state().numpy().tobytes())
    return h.hexdigest()


def fit_until(config: TrainConfig, at: int | None = None, how: str = "crash", rank: int | None = None,
              model: torch.nn.Module | None = None) -> dict:
    """``Trainer(config, model=model).fit()``, ended at loader batch ``at`` as ``_CrashAt`` says (None: to the end).

    Returns the rank, how the run ended ("finished" or "KeyboardInterrupt"; a crash raises), and
    a digest of the RNG states when it ended (in the run's last hook: ``fit`` then restores the caller's).
    """
    seen, end = _Seen(), _RngAtEnd()    # _Seen has no all_ranks: on rank 0 only
    callbacks = [seen, end] + ([_CrashAt(at, how, rank)] if at else [])
    try:
        Trainer(config, callbacks=callbacks, model=model).fit()
        ended = "finished"
    except KeyboardInterrupt:
        ended = "KeyboardInterrupt"
        distributed.teardown()
    return {"rank": distributed.rank(), "ended": ended, "rng": end.digest, "hooks": seen.calls}


class _RngAtEnd(Callback):
    """The RNG states as the run ends (``on_train_end``, inside the run: ``fit`` then puts back the caller's)."""

    all_ranks = True

    def __init__(self):
        self.digest = None

    def on_train_end(self):
        self.digest = rng_digest()


class _Seen(Callback):
    """Counts the hooks it receives."""

    def __init__(self):
        self.calls = 0

    def on_batch_end(self, *args):
        self.calls += 1

    def on_epoch_end(self, row):
        self.calls += 1


def meter_means(batches_of_rank: list[int]) -> dict:
    """LossMeter.epoch_means when each rank adds ``batches_of_rank[rank]`` batches (0: none this epoch)."""
    from yolokit.accel import distributed
    from yolokit.train.meter import LossMeter

    device = distributed.setup(timeout=60)
    try:
        meter = LossMeter(device)
        for i in range(batches_of_rank[distributed.rank()]):
            value = float(distributed.rank() * 10 + i + 1)
            meter.add([({"box": torch.tensor(value), "cls": torch.tensor(2 * value)}, 2)])
        return meter.epoch_means()
    finally:
        distributed.teardown()


def timeless_rows(run_dir: Path) -> list[dict]:
    """results.csv's rows without the columns that depend on the machine's speed (seconds, data%)."""
    return [{k: v for k, v in r.items() if k not in ("seconds", "data%")}
            for r in csv.DictReader((Path(run_dir) / "results.csv").open())]


def relative(x: torch.Tensor, y: torch.Tensor) -> float:
    """||x - y|| / ||y|| (||x|| for a zero y)."""
    x, y = x.double(), y.double()
    return float((x - y).norm() / y.norm().clamp_min(1e-12)) if y.norm() > 0 else float(x.norm())


def fit_with_the_store_stopping(config: TrainConfig, at: int, rank: int) -> dict:
    """``fit_until``, with rank ``rank``'s loader raising a StoreError as its batch ``at`` (counted over the run)
    would come, as a store that stopped does; the run is told its data is remote (``Parts.data_check``)."""
    import dataclasses

    from yolokit.data.loader import DetectionLoader
    from yolokit.data.store.remote import StoreError
    from yolokit.train import trainer

    real_build, real_iter, seen = trainer.build_run, DetectionLoader.__iter__, [0]

    def build(*args, **kwargs):
        built = real_build(*args, **kwargs)
        return dataclasses.replace(built, parts=dataclasses.replace(built.parts, data_check=True))

    def batches(loader):
        for batch in real_iter(loader):
            if loader.batch_sampler.__class__.__name__ == "ShardedBatchSampler":      # training batches only
                seen[0] += 1
                if seen[0] == at and distributed.rank() == rank:
                    raise StoreError("s3://bucket/set/train/chunk-0-3.bin: the store did not answer after 4 tries")
            yield batch

    trainer.build_run, DetectionLoader.__iter__ = build, batches
    return fit_until(config)


def validate_with_the_store_stopping(data: str, weights: str, rank: int) -> dict:
    """``validate_shard``'s validation, with rank ``rank``'s loader raising a StoreError at its second batch;
    returns what this rank raised, and how many of its batches it ran."""
    from yolokit.data.store.remote import StoreError

    distributed.setup(timeout=TIMEOUT_S)
    model, names = load_ema(weights)
    loader = build_dataloader(DetectionDataset(data, "val", imgsz=96, rect=True), 2, workers=0, shuffle=False)
    ran = []

    def batches():
        for i, batch in enumerate(loader):
            if i == 1 and distributed.rank() == rank:
                raise StoreError("s3://bucket/set/val/chunk-0-1.bin: the store did not answer after 4 tries")
            ran.append(i)
            yield batch

    try:
        validate(model, batches(), num_classes=len(names))
        raised = None
    except StoreError as exc:
        raised = f"{type(exc).__name__}: {exc}"
    distributed.teardown()
    return {"raised": raised, "ran": len(ran)}


class EpochLine(Callback):
    """Appends ``rank R epoch E`` to ``path`` at each epoch's end (a file: the ranks are other processes);
    ``every_rank``: on every rank (``all_ranks``), its lines prefixed ``all ranks:``."""

    def __init__(self, path, every_rank: bool = False):
        self.path, self.all_ranks = path, every_rank

    def on_epoch_end(self, row):
        with open(self.path, "a") as f:
            f.write(f"{'all ranks: ' if self.all_ranks else ''}rank {distributed.rank()} epoch {int(row['epoch'])}\n")


@contextlib.contextmanager
def odd_process() -> Iterator[ProcessState]:
    """Inside: what no run sets (seeds, switches, threads, a SIGTERM handler), so that a run that changed one
    and did not put it back is seen; yields that state. On exit the state from before is back."""
    saved = ProcessState.capture()
    try:
        random.seed(11)
        np.random.seed(12)
        torch.manual_seed(13)
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.deterministic = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_num_threads(2)
        signal.signal(signal.SIGTERM, _ignore)
        yield ProcessState.capture()
    finally:
        saved.restore()


def _ignore(signum, frame):
    pass
