"""The trainer's step as CUDA graphs (TrainConfig.cuda_graphs), checked on the CPU through the make_fx
stand-in (tests/_graph_tape.py), whose replays keep Python numbers and tensors as a CUDA graph does.

19 images in micro-batches of 2 with nbs 6: 3 loader batches a step (the step's first zeroes the
gradients, its last steps the optimizer), 4 steps an epoch, the last of 1 image (a shape of its own,
seen once an epoch: never recorded). No warmup, so each epoch's learning rate holds for the epoch: each
kind of batch runs eagerly once (the trainer's two, here one, to fit an epoch), is recorded, then
replayed; the next epoch's rate makes a new graph of the optimizer's step.

The network is tests/fixtures/tiny.yaml (the YOLOv8 head and loss on a few layers): what is recorded and
replayed is the same step as yolov8n's, traced in a fraction of its time; yolov3-tiny's anchor loss runs too.
"""

from __future__ import annotations

import warnings

import _train_workers as workers
import pytest
import torch
from _models import TINY

from tests._graph_tape import TapeBackend
from tests.train.test_resume_iters import assert_same_run
from tests.train.test_resume_iters import config as resume_config
from yolokit.accel import graphs as graphs_module
from yolokit.accel.graphs import StepGraphs
from yolokit.data import make_shapes
from yolokit.train import TrainConfig, Trainer
from yolokit.train import build as build_module
from yolokit.train.checkpoint import load_checkpoint

pytestmark = pytest.mark.usefixtures("clean_env")


class WatchedGraphs(StepGraphs):
    """The trainer's StepGraphs on the stand-in, watching the step's model, optimizer and precision for
    tensors a recording makes and keeps (in a CUDA graph's pool, another graph's replay may overwrite them)."""

    kept: list[str] = []
    warmup = 1     # eager runs of a key before its recording (the trainer's 2: one here, to fit an epoch)

    def __init__(self, step, device, **kw):
        watch = [step.train_net, step.optimizer, step.precision]
        super().__init__(step, device, warmup=self.warmup, backend=TapeBackend(device, watch=watch), **kw)
        original = self.backend.record

        def record(fn):
            out = original(fn)
            WatchedGraphs.kept += self.backend.kept
            return out

        self.backend.record = record
        self.replayed: dict[tuple[bool, bool], int] = {}

    def __call__(self, inputs, *, variant=()):
        before = self.stats.replays
        out = super().__call__(inputs, variant=variant)
        if self.stats.replays > before:      # (first, last) of each replayed batch
            self.replayed[variant[:2]] = self.replayed.get(variant[:2], 0) + 1
        return out


@pytest.fixture
def tape(monkeypatch):
    """Graphs "recorded" on the CPU by the stand-in."""
    monkeypatch.setitem(graphs_module._BACKENDS, "cpu", TapeBackend)
    monkeypatch.setattr(build_module, "StepGraphs", WatchedGraphs)
    WatchedGraphs.kept = []
    return WatchedGraphs


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return str(make_shapes(tmp_path_factory.mktemp("shapes") / "set", n_train=19, n_val=4, imgsz=64))


def config(shapes, out, **kw) -> TrainConfig:
    """test_resume_iters' run (3 epochs, SGD, EMA, close-Mosaic, a checkpoint every 2 steps), without warmup
    and with graphs, of the tiny network."""
    return resume_config(shapes, out, **{"model": TINY, "warmup_epochs": 0.0, "cuda_graphs": True, **kw})


def _fit(cfg: TrainConfig) -> Trainer:
    trainer = Trainer(cfg)
    trainer.fit()
    return trainer


@pytest.fixture(scope="module")
def graphed_reference(shapes, tmp_path_factory):
    """The uninterrupted run with graphs (recorded by the stand-in)."""
    mp = pytest.MonkeyPatch()
    mp.setitem(graphs_module._BACKENDS, "cpu", TapeBackend)
    mp.setattr(build_module, "StepGraphs", WatchedGraphs)
    WatchedGraphs.kept = []
    try:
        out = tmp_path_factory.mktemp("graphed") / "run"
        trainer = _fit(config(shapes, out))
        return out, trainer.parts.graphs, list(WatchedGraphs.kept)
    finally:
        mp.undo()


def _weights(run_dir) -> dict[str, torch.Tensor]:
    return load_checkpoint(run_dir / "weights" / "last.pt")["model"]


@pytest.mark.slow
def test_a_graphed_run_trains_as_the_eager_one(shapes, graphed_reference, tmp_path):
    """Replays take the eager steps' numbers: the same weights up to the rounding of the boxes' padding
    (a bucket of 8 or 16 slots instead of the batch's own count); the graphs were recorded and
    replayed for every kind of batch of the step."""
    out, graphs, kept = graphed_reference
    assert kept == []                     # every gradient and state tensor made before the recordings
    eager_out = tmp_path / "eager"
    _fit(config(shapes, eager_out, cuda_graphs=False))
    a, b = _weights(eager_out), _weights(out)
    for key, value in a.items():
        if value.dtype.is_floating_point:
            assert (b[key] - value).norm() <= 1e-4 * value.norm() + 1e-7, key
        else:
            assert torch.equal(b[key], value), key
    # every kind of batch replayed: the step's first, a middle one, and the last with the optimizer's step
    # (each epoch's rate is a graph of its own, recorded anew)
    assert set(graphs.replayed) == {(True, False), (False, False), (False, True)}
    assert graphs.replayed[(False, True)] >= 2 and graphs.stats.recorded >= 2 + 3
    assert load_checkpoint(out / "weights" / "last.pt")["steps"] == 12


@pytest.mark.slow
@pytest.mark.extended   # the graphed run: test_a_graphed_run_trains_as_the_eager_one; a resume at a step,
# bit for bit: tests/train/test_resume_iters.py (the graphs are recorded anew as after any first step)
def test_a_graphed_run_resumes_bit_for_bit(shapes, graphed_reference, tmp_path, tape):
    """A crash in step 5 and a resume (the graphs recorded again in the new process): the uninterrupted
    graphed run's every tensor and results.csv."""
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="simulated crash"):
        workers.fit_until(config(shapes, out), at=12)
    assert load_checkpoint(out / "weights" / "last.pt")["steps"] == 4
    _fit(TrainConfig(resume=str(out)))
    assert_same_run(graphed_reference[0], out, steps=12)


def test_graphs_say_why_not_and_the_run_goes_on_eagerly(shapes, tmp_path):
    """No backend on the CPU (the stand-in is not registered): a note and a warning, the step eager."""
    with pytest.warns(RuntimeWarning, match="cuda_graphs cannot record this run's step: they need a CUDA device"):
        trainer = _fit(config(shapes, tmp_path / "run", epochs=1, save_period_iters=0))
    assert trainer.parts.graphs is None


def test_musgd_steps_are_recorded(shapes, tmp_path, tape):
    """MuSGD skips on the device as the fused optimizers do (its replays against eager steps:
    tests/accel/test_graphs.py), so a YOLO26 run records its steps; a foreach SGD still cannot."""
    parts = Trainer(config(shapes, tmp_path / "run", epochs=1, model="yolo26n.yaml", optimizer="MuSGD")).setup()
    assert parts.graphs is not None


@pytest.mark.slow
@pytest.mark.extended   # the graphed step's recording and replays: test_a_graphed_run_trains_as_the_eager_one;
# the anchor loss on padded targets: tests/losses/test_padded_targets.py
def test_yolov3_tiny_replays_its_steps_bit_for_bit(shapes, tmp_path, tape, monkeypatch):
    """The anchor head's loss on padded targets (padding rows weigh 0 at every level; the loss itself is
    checked against the rows in tests/losses/test_padded_targets.py). yolov3-tiny at lr 0.01 on 19 images
    turns a rounding difference of 1e-6 into 9% in 8 steps, so the graphed run is compared with the same
    steps run eagerly, never recorded: bit for bit. One epoch: each kind of batch runs eagerly in step 1, is
    recorded in step 2 and replayed in step 3."""
    runs = {}
    for warmup in (1, 10**6):
        monkeypatch.setattr(WatchedGraphs, "warmup", warmup)
        runs[warmup] = _fit(config(shapes, tmp_path / str(warmup), epochs=1, model="yolov3-tiny", save_period_iters=0))
    assert set(runs[1].parts.graphs.replayed) == {(True, False), (False, False), (False, True)}
    assert runs[10**6].parts.graphs.stats.recorded == 0 and tape.kept == []
    a, b = runs[10**6].parts.model.state_dict(), runs[1].parts.model.state_dict()
    assert all(torch.equal(b[key], value) for key, value in a.items())


def test_a_failed_recording_turns_the_graphs_off_and_the_step_is_redone_eagerly(shapes, tmp_path, tape,
                                                                                 monkeypatch):
    """The first recording fails (as a CUDA graph does when the step reads the device): a warning, and
    the run trains on eagerly from that step's first batch, to the eager run's weights."""
    def refuse(self, fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(TapeBackend, "record", refuse)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _fit(config(shapes, tmp_path / "run", epochs=2, save_period_iters=0))
    said = [str(w.message) for w in caught if "CUDA graphs are off" in str(w.message)]
    assert len(said) == 1 and "not permitted when stream is capturing" in said[0]
    assert trainer.parts.graphs.failed is not None and trainer.parts.graphs.graphs == 0
    eager = _fit(config(shapes, tmp_path / "eager", epochs=2, save_period_iters=0, cuda_graphs=False))
    a, b = eager.parts.model.state_dict(), trainer.parts.model.state_dict()
    for key, value in a.items():
        if value.dtype.is_floating_point:
            assert (b[key] - value).norm() <= 1e-4 * value.norm() + 1e-7, key


@pytest.mark.gpu
def test_on_cuda_a_graphed_run_trains_as_the_eager_one(tmp_path):
    """yolov8n at 128 px, batches of 8 (one per step), bf16, channels_last: every step after the first
    two of an epoch with the same boxes' bucket replayed from a CUDA graph; the weights those of the eager
    run (cuDNN's kernels need not be deterministic: within 1% of each tensor's norm, where a stale
    gradient or learning rate moves them by tens of percent)."""
    data = str(make_shapes(tmp_path / "set", n_train=32, n_val=8, imgsz=128))
    runs = {}
    for graphs in (False, True):
        cfg = TrainConfig(data=data, imgsz=128, batch=8, nbs=8, epochs=2, workers=2, out=str(tmp_path / f"g{graphs}"),
                          plots=False, warmup_epochs=0.0, mosaic_buffer=0, seed=3, optimizer="SGD", lr0=0.01,
                          cuda_graphs=graphs, device="cuda")
        runs[graphs] = _fit(cfg)
    trainer = runs[True]
    assert trainer.parts.graphs.failed is None
    stats = trainer.parts.graphs.stats    # 4 steps an epoch; keys also differ by the boxes' bucket (8, 16, 32)
    assert stats.recorded >= 2 and stats.replays >= 2
    a, b = runs[False].parts.model.state_dict(), trainer.parts.model.state_dict()
    for key, value in a.items():
        if value.dtype.is_floating_point:
            assert torch.isfinite(b[key]).all() and (b[key] - value).norm() <= 1e-2 * value.norm() + 1e-6, key


def test_the_reasons_graphs_cannot_apply(tape):
    """Each case graphs_off_reason refuses, and None where the step can be recorded (the stand-in
    records on the CPU here)."""
    from yolokit.losses import YOLOv8Loss
    from yolokit.train.step import graphs_off_reason

    net = torch.nn.Linear(2, 2)
    sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, fused=True)
    loss, cpu = YOLOv8Loss(2, (8, 16, 32)), torch.device("cpu")

    def reason(config=None, world=1, criterion=loss, optimizer=sgd):
        return graphs_off_reason(config or TrainConfig(), device=cpu, world=world, criterion=criterion,
                                 optimizer=optimizer)

    assert reason() is None
    assert "several processes" in reason(world=2)
    assert "Linear takes its targets as rows" in reason(criterion=net)
    assert "SGD decides on the host" in reason(optimizer=torch.optim.SGD(net.parameters(), lr=0.1, foreach=True))
    assert "reduce-overhead records graphs of its own" in reason(config=TrainConfig(compile="reduce-overhead"))
