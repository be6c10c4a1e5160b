"""batch auto: the worst case of the data, a probe that leaves nothing behind, a budget it aims at.

CUDA's memory readings are replaced by an injected memory model whose cost grows with the
images and the boxes per image; on a GPU the same code reads ``torch.cuda`` (gpu marker).
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

import yolokit
from yolokit.accel.amp import Precision
from yolokit.accel.oom import free_memory
from yolokit.data import make_shapes
from yolokit.losses import YOLOv8Loss
from yolokit.train import TrainConfig
from yolokit.train.autobatch import measure_batch, resolve_batch, training_probe, worst_case_boxes

MiB = 2**20


class FakeSet:
    def __init__(self, counts):
        self.index = type("Index", (), {"labels": [np.zeros((n, 5), np.float32) for n in counts]})()


def test_worst_case_boxes_counts_mosaic_and_mixup():
    data = FakeSet([0, 3, 7, 1])
    assert worst_case_boxes(data, TrainConfig()) == 28                 # 4 images in a Mosaic
    assert worst_case_boxes(data, TrainConfig().replace(mixup=0.1)) == 56        # and MixUp blends two
    assert worst_case_boxes(data, TrainConfig().replace(mosaic=0.0)) == 7
    assert worst_case_boxes(FakeSet([0, 0]), TrainConfig()) == 1
    assert worst_case_boxes(data, TrainConfig(rect=True).replace(mixup=0.1)) == 7    # rect: neither


def _parts(seen):
    torch.manual_seed(0)
    model = yolokit.create_model("yolov8n", num_classes=3)
    loss = YOLOv8Loss(3, model.strides)
    original = loss.forward

    def recording(maps, targets, max_boxes=None):
        seen.append((maps[0].shape[0], tuple(targets.shape), max_boxes, all(p.grad is not None
                                                                           for p in model.parameters()
                                                                           if p.requires_grad)))
        return original(maps, targets, max_boxes=max_boxes)

    loss.forward = recording
    return model, loss


def test_the_probe_runs_the_worst_case_and_leaves_nothing_behind():
    seen = []
    model, loss = _parts(seen)
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    probe = training_probe(model, model, loss, Precision("fp32", "cpu"), torch.device("cpu"), imgsz=64,
                           max_boxes=30, state_tensors=2, channels_last=False)
    probe(3)
    assert seen == [(3, (90, 6), 30, True)]     # 30 boxes in each of 3 images, gradients allocated
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():      # weights and BatchNorm statistics as they were
        assert torch.equal(v, before[k]), k


def test_the_probe_holds_what_the_run_adds_around_a_step(monkeypatch):
    """Several processes: the all-reduce's flat gradient buffers and SyncBatchNorm's gathered
    statistics are held during the step; validation's forward runs at twice the batch, in eval
    mode without gradients, and the model comes back in train mode."""
    seen = []
    model, loss = _parts(seen)
    model.train()
    forwards = []
    model.register_forward_hook(lambda m, args, out: forwards.append(
        (args[0].shape[0], m.training, torch.is_grad_enabled(), all(p.grad is None for p in m.parameters()))))
    allocated = []
    for name in ("empty", "zeros"):
        real = getattr(torch, name)

        def spy(*shape, _real=real, **kwargs):
            out = _real(*shape, **kwargs)
            allocated.append(out.numel())
            return out

        monkeypatch.setattr(torch, name, spy)
    probe = training_probe(model, model, loss, Precision("fp32", "cpu"), torch.device("cpu"), imgsz=64,
                           max_boxes=5, state_tensors=1, channels_last=False, world=4, sync_bn=True)
    probe(3)
    monkeypatch.undo()
    grads = sum(p.numel() for p in model.parameters() if p.requires_grad)
    bn = sum(m.num_features for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    assert grads in allocated and 2 * (4 + 2) * bn in allocated
    assert forwards == [(3, True, True, False), (6, False, False, True)]   # the step, then validation at 2b
    assert seen == [(3, (15, 6), 5, True)] and model.training
    assert all(p.grad is None for p in model.parameters())


def test_each_size_is_measured_on_its_second_run(monkeypatch):
    """The first run at a size pays for algorithm search and first-call allocations: not measured."""
    from yolokit.accel import batch_size

    peaks, runs = {"now": 0}, []

    def step(b):
        runs.append(b)
        peaks["now"] = max(peaks["now"], (500 if len(runs) == 1 else 100) * b)   # the first run allocates more

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: peaks.update(now=0))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peaks["now"])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    assert batch_size.measure_peak_memory(step, 4, device="cuda:0") == 400 and runs == [4, 4]
    runs.clear()
    # without the warm-up run, the cold run's peak (5x here) would be what the fit reads
    assert batch_size.measure_peak_memory(step, 2, device="cuda:0", warmup=0) == 1000 and runs == [2]


def _fake_memory(probe, boxes, limit):
    """Peak bytes of a step: 100 MiB fixed, 10 MiB per image, 0.05 MiB per box; OOM above ``limit``."""
    cost = lambda b: (100 + b * (10 + 0.05 * boxes)) * MiB  # noqa: E731

    def step(b):
        probe(b)
        if cost(b) > limit:
            raise RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED")   # counts as out of memory

    return step, cost


# boxes=1 searches up to 70 real 64-px images a step (30 s here); 400 boxes, the same search, to 23
@pytest.mark.parametrize("boxes", [pytest.param(1, marks=pytest.mark.extended), 400])
def test_measure_aims_at_the_budget_and_boxes_cost_batch(boxes, capsys):
    seen = []
    model, loss = _parts(seen)
    probe = training_probe(model, model, loss, Precision("fp32", "cpu"), torch.device("cpu"), imgsz=64,
                           max_boxes=boxes, state_tensors=1, channels_last=False)
    limit = 1000 * MiB
    step, cost = _fake_memory(probe, boxes, limit)
    size = measure_batch(step, torch.device("cpu"), fraction=0.8,
                         memory=(limit, lambda b: (step(b), cost(b))[1]))
    assert cost(size) <= 0.8 * limit < cost(size + 1)
    assert size == (69 if boxes == 1 else 23)      # 400 boxes per image make each image 3x as costly
    out = capsys.readouterr().out
    first = "1: 110 MiB" if boxes == 1 else "1: 130 MiB"
    assert "budget 80% of 0.98 GiB" in out and first in out and out.rstrip().endswith(f"-> {size} images per step")
    assert f", {size}: " in out                     # the first prediction, measured: it is the answer
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.extended   # 16 s of real steps; the search below: tests/accel/test_batch_size.py (predict_* tests)
def test_a_prediction_that_does_not_fit_is_searched_below(capsys):
    seen = []
    model, loss = _parts(seen)
    probe = training_probe(model, model, loss, Precision("fp32", "cpu"), torch.device("cpu"), imgsz=64,
                           max_boxes=400, state_tensors=1, channels_last=False)
    step, cost = _fake_memory(probe, 400, limit=1000 * MiB)   # 30 MiB an image: real steps of ~20 images
    # the memory model under-reads (peaks look 40% smaller than they are): the check step fails
    size = measure_batch(lambda b: step(b) if cost(b) <= 600 * MiB else
                         (_ for _ in ()).throw(torch.OutOfMemoryError("injected")), torch.device("cpu"),
                         fraction=0.8, memory=(1000 * MiB, lambda b: (step(b), 0.6 * cost(b))[1]))
    assert cost(size) <= 600 * MiB < cost(size + 1)
    assert "out of memory" in capsys.readouterr().out


def test_resolve_batch(tmp_path):
    cpu = torch.device("cpu")
    assert resolve_batch(TrainConfig(batch=12), None, cpu, world=1, main=True) == 12
    lines = []
    assert resolve_batch(TrainConfig(batch="auto"), None, cpu, world=1, main=True,
                         report=lines.append) == 16  # nothing to measure
    assert lines == ["batch auto: no CUDA device to measure, using 16 per process",
                     "batch auto: 16 images per process (16 in all)"]
    assert resolve_batch(TrainConfig(batch="auto"), None, cpu, world=1, main=True, resumed={"batch": 40}) == 40


@pytest.mark.slow
def test_the_trainer_probes_its_dataset(tmp_path, monkeypatch, capsys):
    from yolokit.train import autobatch, train

    shapes = str(make_shapes(tmp_path / "set", n_train=8, n_val=4, imgsz=64, max_objects=5))
    calls = []

    def measure(probe, device, **kw):
        probe(2)
        calls.append(device.type)
        return 4

    monkeypatch.setattr(autobatch, "measure_batch", measure)
    train(TrainConfig(data=shapes, imgsz=64, batch="auto", nbs=4, epochs=1, workers=0, plots=False,
                      out=str(tmp_path / "run")))
    assert calls == ["cpu"] and "batch 4 (4 per process)" in capsys.readouterr().out


def test_a_probe_can_validate_at_another_size(monkeypatch):
    """Multi-scale training probes its largest size; validation's forward stays at imgsz."""
    model, loss = _parts([])
    forward, sizes = model.forward, []

    def recording(images):
        sizes.append((model.training, tuple(images.shape)))
        return forward(images)

    monkeypatch.setattr(model, "forward", recording)
    probe = training_probe(model, model, loss, Precision("fp32", "cpu"), torch.device("cpu"), imgsz=96,
                           max_boxes=3, state_tensors=1, channels_last=False, val_imgsz=64)
    probe(1)
    assert sizes == [(True, (1, 3, 96, 96)), (False, (2, 3, 64, 64))]


class _Measured(Exception):
    """Ends a run's setup once the batch finder has probed."""


@pytest.mark.parametrize("multi_scale,rect,trained", [(True, False, 96), (False, True, 64),
                                                      pytest.param(False, False, 64, marks=pytest.mark.extended)])
def test_the_trainer_probes_the_largest_multi_scale_size(tmp_path, monkeypatch, multi_scale, rect, trained):
    from yolokit.train import autobatch, train

    shapes = str(make_shapes(tmp_path / "set", n_train=4, n_val=2, imgsz=64, max_objects=2))
    sizes = []
    monkeypatch.setattr(autobatch, "_validation_forward", lambda model, b, imgsz, *a: sizes.append(("val", imgsz)))
    step = autobatch.forward_backward
    monkeypatch.setattr(autobatch, "forward_backward", lambda net, crit, prec, images, targets, **kw: (
        sizes.append(("train", tuple(images.shape[-2:]))), step(net, crit, prec, images, targets, **kw))[1])

    def measure(probe, device, **kw):
        probe(1)
        raise _Measured

    monkeypatch.setattr(autobatch, "measure_batch", measure)
    with pytest.raises(_Measured):
        train(TrainConfig(data=shapes, imgsz=64, batch="auto", epochs=1, workers=0, plots=False,
                          multi_scale=multi_scale, rect=rect, out=str(tmp_path / "run")))
    assert sizes == [("train", (trained, trained)), ("val", 64)]    # 1.5 x 64 with multi_scale


def _grid_constants(model) -> list[dict]:
    """The head's cached grid points and strides (`ops.cache.ConstantCache`), per key."""
    return [m._grids.store for m in model.modules() if hasattr(m, "_grids")]


def _live_tensors() -> list[torch.Tensor]:
    gc.collect()
    # type(), not isinstance(): isinstance asks each object its __class__, and some module proxies
    # (torch.distributed.reduce_op) warn when asked
    return [t for t in gc.get_objects() if issubclass(type(t), torch.Tensor)]


def test_a_measure_leaves_only_the_grid_constants_behind():
    """The CPU's stand-in for the CUDA test below, where memory_allocated cannot be read.

    Every tensor that lived before the measure lives after it (no gradient, BatchNorm buffer or
    state of the caller's freed or replaced), and the only tensors the measure leaves are the
    grid points and strides the head caches for validation's forward, which the run keeps anyway.
    """
    model, loss = _parts([])
    model.train()
    probe = training_probe(model, model, loss, Precision("fp32", "cpu"), torch.device("cpu"), imgsz=64,
                           max_boxes=5, state_tensors=2, channels_last=False)
    step, cost = _fake_memory(probe, 5, limit=300 * MiB)           # 100 MiB and 10.25 MiB an image
    before = {id(t): weakref.ref(t) for t in _live_tensors()}
    size = measure_batch(step, torch.device("cpu"), fraction=0.5, memory=(300 * MiB, lambda b: (step(b), cost(b))[1]))
    assert size == 4
    after = _live_tensors()
    assert all(ref() is not None for ref in before.values())
    new = {t.untyped_storage().data_ptr() for t in after if id(t) not in before}
    stores = _grid_constants(model)
    assert [len(store) for store in stores] == [1]                # validation's 64-px maps: one key
    kept = {t.untyped_storage().data_ptr() for t in next(iter(stores[0].values()))}
    assert len(kept) == 2 and new == kept
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.gpu
def test_cuda_measure_fits_and_leaves_memory_free():
    # The first GPU pass read 77,824 bytes fewer after the measure than before. Those were not the
    # caller's: the test before this one in that run (test_yolov8_loss.py's CUDA step) had failed,
    # and pytest's record of the failure (frames that hold its maps, targets and autograd graph, in
    # reference cycles with the exception) became garbage when this test started. It was still
    # allocated at `before`; the measure's free_memory() runs gc.collect(), which freed it. (A CPU
    # run of that step holds 46,080 bytes of maps and targets and 172,032 with its whole graph, in
    # 512-byte blocks; the measure also left the head's grid constants for validation's forward,
    # 25,600 bytes at 320 px: 77,824 + 25,600 = 103,424 bytes were freed, between those two.)
    # So: one probe first makes what stays for the run (the head's grid constants; cuBLAS and
    # cuBLASLt workspaces, which the caching allocator counts; an fp16 scaler's scale), then
    # garbage is collected, then `before` is read, and the measure must leave exactly that.
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = yolokit.create_model("yolov8n", num_classes=80).to(device).train()
    loss = YOLOv8Loss(80, model.strides)
    probe = training_probe(model, model, loss, Precision("auto", device), device, imgsz=320, max_boxes=50,
                           state_tensors=2, channels_last=False)
    probe(1)
    free_memory()
    before = torch.cuda.memory_allocated(device)
    size = measure_batch(probe, device, fraction=0.5, max_size=256)
    assert 1 < size <= 256
    probe(size)                                   # the size found runs
    assert [len(store) for store in _grid_constants(model)] == [1]    # validation's 320-px maps: one key
    assert torch.cuda.memory_allocated(device) == before   # nothing left behind, nothing of the caller's freed
