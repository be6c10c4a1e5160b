"""Resume at any optimizer step: the resumed run ends with the uninterrupted run's bits.

13 training images in micro-batches of 2 make 7 micro-batches per epoch (the last holds 1
image); ``nbs`` 6 accumulates 3, so an epoch is 3 optimizer steps (3, 3 and 1 micro-batches)
and ``save_period_iters`` 2 writes ``last.pt`` at steps 2, 4, 6, 8: never at an epoch end in
epoch 2, whose first step is global step 4. Three epochs with EMA, warmup, the LR schedule and
the close-Mosaic switch in the last epoch. The run is ended in several ways (a crash, as a
killed process leaves the files; Ctrl-C between steps; Ctrl-C inside an optimizer step), then
resumed, and every tensor of the final ``last.pt`` must equal the uninterrupted run's
(``torch.equal``), as must ``results.csv`` (except the seconds). The network is tests/fixtures/tiny.yaml
(YOLOv8's head and loss on a few layers): the subject is the trainer's state, not the architecture.
"""

from __future__ import annotations

import csv
import gc
import os
import signal
import traceback
import weakref

import _train_workers as workers
import pytest
import torch
from _models import TINY
from _processes import alive, descendants

from yolokit.accel import Interrupted
from yolokit.accel.launcher import LaunchError, launch
from yolokit.data import DetectionDataset, ShardedBatchSampler, make_shapes
from yolokit.models import Detector
from yolokit.testing import assert_weights_equal
from yolokit.train import Callback, TrainConfig, Trainer, train
from yolokit.train.checkpoint import load_checkpoint
from yolokit.train.ema import ModelEMA
from yolokit.train.process_state import ProcessState

pytestmark = pytest.mark.usefixtures("clean_env", "forked_ranks")   # no torchrun variables: one process unless told


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return str(make_shapes(tmp_path_factory.mktemp("shapes") / "set", n_train=13, n_val=4, imgsz=64))


def config(shapes, out, **kw) -> TrainConfig:
    base = dict(model=TINY, data=shapes, imgsz=64, batch=2, nbs=6, epochs=3, workers=0, out=str(out), plots=False,
                warmup_epochs=1.0, close_mosaic=1, mosaic_buffer=0, seed=3, optimizer="SGD", lr0=0.01,
                save_period_iters=2)
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def reference(shapes, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "run"
    Trainer(config(shapes, out)).fit()
    return out


def _rows(run_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("seconds", "data%")}
            for r in csv.DictReader((run_dir / "results.csv").open())]


def assert_same_run(reference, resumed, *, steps: int = 9, epochs: int = 3):
    """Every tensor of the final checkpoint, and results.csv, equal bit for bit."""
    a = load_checkpoint(reference / "weights" / "last.pt")
    b = load_checkpoint(resumed / "weights" / "last.pt")
    assert a["epoch"] == b["epoch"] == epochs and a["steps"] == b["steps"] == steps
    assert a["ema"]["updates"] == b["ema"]["updates"] == steps
    assert_weights_equal(a["model"], b["model"])                    # weights and BatchNorm statistics
    assert_weights_equal(a["ema"]["module"], b["ema"]["module"])
    for key, value in a["optimizer"]["state"].items():
        assert torch.equal(b["optimizer"]["state"][key]["momentum_buffer"], value["momentum_buffer"]), key
    assert a["best_fitness"] == b["best_fitness"]
    assert _rows(resumed) == _rows(reference)


# --- the sampler ------------------------------------------------------------------------------


@pytest.mark.parametrize("world,accumulate", [(1, 3), (2, 2), (3, 1)])
def test_sampler_start_step_leaves_out_exactly_the_steps_taken(world, accumulate):
    for start in range(4):
        for r in range(world):
            full = ShardedBatchSampler(25, 2, rank=r, world_size=world, accumulate=accumulate, seed=1)
            full.set_epoch(4)
            batches = list(full)
            resumed = ShardedBatchSampler(25, 2, rank=r, world_size=world, accumulate=accumulate, seed=1)
            resumed.set_epoch(4, start_step=start)
            assert list(resumed) == batches[start * accumulate:] and len(resumed) == len(batches[start * accumulate:])


def test_loader_resumes_only_the_epoch_it_was_told(shapes):
    from yolokit.data import build_dataloader

    ds = DetectionDataset(shapes, "train", imgsz=64, augment=True)
    loader = build_dataloader(ds, 2, workers=0, seed=0, accumulate=3)
    loader.set_epoch(1, start_step=2)
    assert len(loader) == 1                       # what the iteration yields (the progress bar, the Accumulator)
    assert [b["indices"] for b in loader] == [list(b) for b in list(_epoch(1))[6:]]
    loader.set_epoch(2)
    assert len(loader) == 7 and len(list(loader)) == 7


def _epoch(epoch):
    sampler = ShardedBatchSampler(13, 2, accumulate=3, seed=0)
    sampler.set_epoch(epoch)
    return sampler


# --- one process ------------------------------------------------------------------------------


@pytest.mark.slow
def test_crash_after_an_iteration_checkpoint_resumes_bit_for_bit(shapes, reference, tmp_path, monkeypatch):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="simulated crash"):
        workers.fit_until(config(shapes, out), at=12)          # in step 5: last.pt is step 4's
    state = load_checkpoint(out / "weights" / "last.pt")
    assert (state["epoch"], state["step_in_epoch"], state["steps"]) == (1, 1, 4)
    assert len(state["ranks"]) == 1 and state["ranks"][0]["meter"]["keys"] == ["box", "cls", "dfl"]

    loaded = []
    original = DetectionDataset.__getitem__

    def counting(self, index):
        if self.augment:
            loaded.append(index)
        return original(self, index)

    monkeypatch.setattr(DetectionDataset, "__getitem__", counting)
    Trainer(TrainConfig(resume=str(out))).fit()
    assert len(loaded) == (13 - 6) + 13                        # the 3 micro-batches of step 4 not loaded again
    assert_same_run(reference, out)


@pytest.mark.slow
def test_ctrl_c_between_steps_drops_the_partial_step(shapes, reference, tmp_path):
    """SIGINT after the first micro-batch of step 5: its gradients and its BatchNorm updates are dropped.

    Through ``train()``, as in a notebook: the stop is one line naming the resume in Python, it holds
    nothing of the run (no trainer frame, no chained exception; no Trainer or Detector left, the memory
    back), a second Ctrl-C during the cleanup still closes the loaders and reaches every ``on_train_end``,
    the process is as it was, and the same process then resumes to the uninterrupted run's bits."""
    out = tmp_path / "run"
    ended = _Ended()
    torch.use_deterministic_algorithms(torch.are_deterministic_algorithms_enabled())   # torch's first-use imports
    gc.collect()
    before, memory, children = ProcessState.capture(), resident_mb(), alive(descendants(os.getpid()))
    held = weakref.WeakSet(_of_a_run())                    # other tests' models, alive in this test process
    with pytest.raises(Interrupted) as stopped:
        train(config(shapes, out, save_period_iters=0, workers=1), callbacks=[workers._CrashAt(11, "SIGINT"),
                                                                               _AgainAtInterrupt(), ended])
    stop = stopped.value
    assert str(stop) == (f"stopped by SIGINT after 4 optimizer steps, saved in {out}; resume with "
                         f'train(TrainConfig(resume="{out}"))')
    assert stop.exit_code == 130 and stop._render_traceback_() == [f"Interrupted: {stop}"]   # a notebook's cell
    assert stop.__context__ is None and stop.__cause__ is None
    frames = [f.f_code.co_name for f, _ in traceback.walk_tb(stop.__traceback__)]
    assert frames[1:] == ["train"], frames                    # no frame of the trainer, none holding it
    del stopped
    gc.collect()
    assert [o for o in _of_a_run() if o not in held] == []
    assert resident_mb() - memory < 100, (memory, resident_mb())
    assert ended.calls == 1 and ended.children <= children   # the run's workers ended before on_train_end
    assert ProcessState.capture().differences(before) == []
    state = load_checkpoint(out / "weights" / "last.pt")     # written by the interrupt, not periodically
    assert (state["epoch"], state["step_in_epoch"], state["steps"]) == (1, 1, 4)
    train(TrainConfig(resume=str(out)))
    assert_same_run(reference, out)


class _AgainAtInterrupt(Callback):
    """A second Ctrl-C as the stop is handled: it cuts the callbacks' ``on_interrupt`` short, not the cleanup."""

    def on_interrupt(self, steps, run_dir):
        os.kill(os.getpid(), signal.SIGINT)


class _Ended(Callback):
    """Counts ``on_train_end`` and sees which processes this one still has then."""

    def __init__(self):
        self.calls, self.children = 0, None

    def on_train_end(self):
        self.calls += 1
        self.children = alive(descendants(os.getpid()))


def _of_a_run() -> list:
    """The Trainers, Detectors and EMAs alive in this process."""
    return [o for o in gc.get_objects() if type(o) in (Trainer, Detector, ModelEMA)]


def resident_mb() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.slow
def test_ctrl_c_inside_an_optimizer_step_waits_for_its_end(shapes, reference, tmp_path, monkeypatch):
    out = tmp_path / "run"
    calls = {"n": 0}
    original = ModelEMA.update

    def signalled(self, model):
        calls["n"] += 1
        if calls["n"] == 5:
            signal.raise_signal(signal.SIGINT)              # between the optimizer step and the EMA update
        return original(self, model)

    monkeypatch.setattr(ModelEMA, "update", signalled)
    with pytest.raises(KeyboardInterrupt):
        Trainer(config(shapes, out, save_period_iters=0)).fit()
    monkeypatch.undo()
    state = load_checkpoint(out / "weights" / "last.pt")
    assert (state["epoch"], state["step_in_epoch"], state["steps"]) == (1, 2, 5)
    assert state["ema"]["updates"] == 5
    Trainer(TrainConfig(resume=str(out))).fit()
    assert_same_run(reference, out)


@pytest.fixture(scope="module")
def shapes96(tmp_path_factory):
    """96 px: 4 of the 13 images make 64 x 96 rect shapes (at 64 px every shape pads to 64 x 64), and
    multi-scale sizes stay >= 64 (a 32 px step would leave the 1-image micro-batch's BatchNorm one value)."""
    return str(make_shapes(tmp_path_factory.mktemp("shapes96") / "set", n_train=13, n_val=4, imgsz=96))


@pytest.mark.slow
@pytest.mark.parametrize("option", ["multi_scale", "rect"])
def test_multi_scale_and_rect_runs_resume_bit_for_bit(option, shapes96, tmp_path):
    """A step's size comes from (seed, epoch, step); rect batches keep their groups and their epoch's order.
    Two epochs (6 steps), ended in the second."""
    whole, out = tmp_path / "whole", tmp_path / "run"
    Trainer(config(shapes96, whole, imgsz=96, epochs=2, **{option: True})).fit()
    with pytest.raises(RuntimeError, match="simulated crash"):
        workers.fit_until(config(shapes96, out, imgsz=96, epochs=2, **{option: True}), at=12)   # step 5; last.pt: 4
    state = load_checkpoint(out / "weights" / "last.pt")
    assert (state["epoch"], state["step_in_epoch"], state["steps"]) == (1, 1, 4) and state["train_config"][option]
    Trainer(TrainConfig(resume=str(out))).fit()
    assert_same_run(whole, out, steps=6, epochs=2)


# --- two processes (gloo) -----------------------------------------------------------------------
# batch 4 (2 per process), nbs 8: 2 micro-batches per rank per step; 21 images make 11 micro-batches,
# steps of 4, 4 and 3 (rank 1 has one micro-batch in the last step): 6 per epoch on rank 0, 5 on rank 1.


@pytest.fixture(scope="module")
def shapes21(tmp_path_factory):
    return str(make_shapes(tmp_path_factory.mktemp("shapes21") / "set", n_train=21, n_val=4, imgsz=64))


@pytest.fixture(scope="module")
def reference2(shapes21, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference2") / "run"
    results = launch(workers.fit_until, 2, config(shapes21, out, batch=4, nbs=8), timeout=300)
    return out, results


@pytest.mark.slow
@pytest.mark.extended   # a lost rank stops the run and is named: tests/train/test_faults.py; two processes
# resume bit for bit: test_two_processes_stop_together_on_sigterm_and_resume_bit_for_bit
def test_two_processes_resume_bit_for_bit_after_a_lost_rank(shapes21, reference2, tmp_path):
    reference, finished = reference2
    assert [r["ended"] for r in finished] == ["finished", "finished"] and finished[0]["rng"] != finished[1]["rng"]
    assert finished[0]["hooks"] > 0 and finished[1]["hooks"] == 0    # a user callback: rank 0 only by default
    out = tmp_path / "run"
    cfg = config(shapes21, out, batch=4, nbs=8)
    with pytest.raises(LaunchError):                            # rank 0 fails in step 5; rank 1 loses it
        launch(workers.fit_until, 2, cfg, 9, "crash", 0, timeout=300)
    state = load_checkpoint(out / "weights" / "last.pt")
    assert (state["epoch"], state["step_in_epoch"], state["steps"]) == (1, 1, 4)
    assert len(state["ranks"]) == 2
    assert not torch.equal(state["ranks"][0]["rng"]["torch"], state["ranks"][1]["rng"]["torch"])
    resumed = launch(workers.fit_until, 2, TrainConfig(resume=str(out)), timeout=300)
    assert [r["rng"] for r in resumed] == [r["rng"] for r in finished]   # each rank restored its own RNG
    assert_same_run(reference, out)


@pytest.mark.slow
def test_a_store_stopped_under_one_rank_stops_both_at_the_last_step_both_finished(shapes21, tmp_path):
    """Rank 1's data stops as its 10th batch would come (its one micro-batch of step 6, epoch 2's last, where
    rank 0 has two): both ranks raise the same one-line error before that step's gradients are exchanged,
    last.pt is at step 5 (the last both finished), with both ranks' state."""
    from yolokit.data.store.remote import StoreError

    out = tmp_path / "run"
    with pytest.raises(LaunchError) as stopped:
        launch(workers.fit_with_the_store_stopping, 2, config(shapes21, out, batch=4, nbs=8, save_period_iters=0),
               10, 1, timeout=300)
    errors = stopped.value.errors
    assert sorted(errors) == [0, 1] and all(isinstance(e, StoreError) for e in errors.values())
    assert str(errors[1]).startswith("the data stopped: s3://bucket/set/train/chunk-0-3.bin: the store did not")
    want = (f"(rank 1); {out / 'weights' / 'last.pt'} holds step 5: when the store is "
            f"back, resume with `yolokit train --resume {out}`")
    assert str(errors[0]).endswith(want), (str(errors[0])[-250:], want)
    state = load_checkpoint(out / "weights" / "last.pt")
    assert (state["epoch"], state["step_in_epoch"], state["steps"]) == (1, 2, 5)
    assert [r["meter"]["counts"][0].item() for r in state["ranks"]] == [4.0, 4.0]   # epoch 2's batches so far
    # resuming from such a checkpoint is the test above's; through the CLI and a real store: test_train_shards


@pytest.mark.slow
def test_two_processes_stop_together_on_sigterm_and_resume_bit_for_bit(shapes21, reference2, tmp_path):
    """SIGTERM reaches rank 1 only, in step 4; both ranks agree to stop at the end of step 6 (the
    epoch's last), write last.pt there, and the resumed run starts with that epoch's validation."""
    reference, finished = reference2
    out = tmp_path / "run"
    cfg = config(shapes21, out, batch=4, nbs=8, save_period_iters=0)
    stopped = launch(workers.fit_until, 2, cfg, 7, "SIGTERM", 1, timeout=300)
    assert [r["ended"] for r in stopped] == ["KeyboardInterrupt", "KeyboardInterrupt"]
    state = load_checkpoint(out / "weights" / "last.pt")
    assert (state["epoch"], state["step_in_epoch"], state["steps"]) == (1, 3, 6)
    assert [r["meter"]["counts"][0].item() for r in state["ranks"]] == [6.0, 5.0]   # the epoch's batches
    resumed = launch(workers.fit_until, 2, TrainConfig(resume=str(out)), timeout=300)
    assert [r["rng"] for r in resumed] == [r["rng"] for r in finished]
    assert_same_run(reference, out)


@pytest.mark.slow
def test_rows_of_epochs_without_validation_keep_the_last_result_across_a_resume(shapes, tmp_path, monkeypatch):
    """val_interval 2 over 4 epochs: epoch 3 is not validated and repeats epoch 2's metrics, also
    when the run is resumed inside epoch 3 (from step 8's checkpoint). Validation is stubbed to
    return distinct numbers per call (a model this small scores 0 everywhere)."""
    import yolokit.train.trainer as trainer_module

    real = trainer_module.validate
    calls = []

    def numbered(*args, **kwargs):
        result, samples = real(*args, **kwargs)
        calls.append(1)
        result.map50_95, result.recall = 0.1 * len(calls), 0.05 * len(calls)
        return result, samples

    monkeypatch.setattr(trainer_module, "validate", numbered)
    whole, out = tmp_path / "whole", tmp_path / "run"
    Trainer(config(shapes, whole, epochs=4, val_interval=2)).fit()
    calls.clear()
    with pytest.raises(RuntimeError, match="simulated crash"):
        workers.fit_until(config(shapes, out, epochs=4, val_interval=2), at=21)   # in step 9
    state = load_checkpoint(out / "weights" / "last.pt")
    assert (state["epoch"], state["step_in_epoch"]) == (2, 2)
    Trainer(TrainConfig(resume=str(out))).fit()
    rows = _rows(out)
    assert rows == _rows(whole)
    assert [float(r["mAP50-95"]) for r in rows] == pytest.approx([0.0, 0.1, 0.1, 0.2])
