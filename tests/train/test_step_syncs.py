"""The trainer's step never makes the host wait for the device, nor the device for the host.

Every call that makes up a training step (``train_step``: the micro-batches' forward, loss and
backward, the loss meter, the gradient sync, the optimizer step with its learning rate,
clipping, skip-on-inf and EMA update; ``after_step``: the ranks' exchange) runs under
``count_host_syncs`` (tests/_host_sync.py: reads back, data-dependent shapes, accumulating
index_put, host values written through indexing, host data made into tensors), for yolov8n,
yolov3-tiny and a model YAML; the reads the trainer makes on purpose (every 16 batches and at
the end of the epoch) are outside those calls.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from _host_sync import count_host_syncs
from _models import TINY

import yolokit.train.trainer as trainer_module
from yolokit.data import make_shapes
from yolokit.train import TrainConfig, Trainer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return str(make_shapes(tmp_path_factory.mktemp("shapes") / "set", n_train=12, n_val=4, imgsz=64))


def _counted(monkeypatch, owner, name, counts: Counter, calls: Counter, details: list | None = None):
    original = getattr(owner, name)
    details = [] if details is None else details

    def wrapper(*args, **kwargs):
        with count_host_syncs() as syncs:
            out = original(*args, **kwargs)
        counts.update(syncs)
        details.extend(syncs.details)
        calls[name] += 1
        return out

    monkeypatch.setattr(owner, name, wrapper)


@pytest.mark.parametrize("model,precision", [("yolov8n", "fp32"), ("yolov3-tiny", "fp32"), ("yolov8n", "fp16"),
                                             ("yolo11n.yaml", "fp32")])
def test_a_training_step_reads_nothing_back(shapes, tmp_path, monkeypatch, model, precision):
    counts, calls, details = Counter(), Counter(), []
    for owner, name in ((trainer_module, "train_step"), (Trainer, "after_step")):
        _counted(monkeypatch, owner, name, counts, calls, details)
    cfg = TrainConfig(model=model, data=shapes, imgsz=64, batch=2, nbs=4, epochs=1, workers=0, plots=False,
                      out=str(tmp_path / "run"), warmup_epochs=1.0, precision=precision)
    Trainer(cfg).fit()
    assert calls["train_step"] == 6 + 1 and calls["after_step"] == 3   # 6 batches, 3 steps (+ the epoch's end)
    assert not counts, details


def test_the_counter_sees_a_read_in_the_step(shapes, tmp_path, monkeypatch):
    """The same harness catches a read put back into the optimizer step."""
    counts, calls = Counter(), Counter()
    original = Trainer.after_step

    def reading(self, epoch):
        original(self, epoch)
        float(next(self.parts.model.parameters()).detach().sum())   # a host read of the device

    monkeypatch.setattr(Trainer, "after_step", reading)
    _counted(monkeypatch, Trainer, "after_step", counts, calls)
    cfg = TrainConfig(data=shapes, imgsz=64, batch=4, nbs=4, epochs=1, workers=0, plots=False,
                      out=str(tmp_path / "run"))
    Trainer(cfg).fit()
    assert counts["_local_scalar_dense"] == calls["after_step"] == 3


def test_compile_true_compiles_the_training_network_and_its_loss(shapes, tmp_path, monkeypatch, capsys):
    """What ``compile=True`` asks of torch.compile (recorded here; the modules run as they are): the
    training network in the run's mode, the loss with symbolic sizes (its targets follow max_boxes); the
    EMA and validation stay eager, and the run says the first step waits for the compile. That the
    compiled run trains what the eager one trains: the extended test below (aot_eager, 35 s)."""
    from yolokit.accel import perf

    asked = []

    def compile_(module, **kw):
        asked.append((type(module).__name__, kw))
        return module

    monkeypatch.setattr(perf.torch, "compile", compile_)
    cfg = TrainConfig(model=TINY, data=shapes, imgsz=64, batch=4, nbs=8, epochs=1, workers=0, plots=False,
                      checkpointing="all", compile="max-autotune", out=str(tmp_path / "run"))
    trainer = Trainer(cfg)
    trainer.fit()
    assert asked == [("Detector", {"mode": "max-autotune", "backend": "inductor"}),
                     ("YOLOv8Loss", {"mode": None, "backend": "inductor", "dynamic": True})]
    assert trainer.progress.steps == 2                     # 3 batches of 4, 2 a step: the run trained through them
    assert "torch.compile compiles the training network and its loss on the first step" in capsys.readouterr().out


@pytest.mark.extended   # 35 s of aot_eager tracing; the default run: the test above (what the trainer compiles)
@pytest.mark.parametrize("model", [pytest.param(TINY, id="tiny"), "yolov8n"])
def test_compiled_checkpointed_training_equals_eager(shapes, tmp_path, monkeypatch, model):
    """The trainer's compile (aot_eager here: the same graphs as inductor, no C++ build) with
    activation checkpointing, channels_last and an accumulation over an uneven epoch trains
    what the eager run trains. The default run compiles the smallest network with a C2f block (what
    checkpointing wraps) and the YOLOv8 loss; yolov8n's compile is the extended case."""
    import csv

    from yolokit.accel import perf

    original = perf.prepare_model
    compiled_nets = []

    def prepare(model, **kw):
        net = original(model, **kw, **({"compile_backend": "aot_eager"} if kw.get("compile") else {}))
        if isinstance(net, torch._dynamo.eval_frame.OptimizedModule):
            compiled_nets.append(net)
        return net

    monkeypatch.setattr(perf, "prepare_model", prepare)
    rows = {}
    for compiled in (False, True):
        cfg = TrainConfig(model=model, data=shapes, imgsz=64, batch=4, nbs=8, epochs=2, workers=0, plots=False,
                          checkpointing="all", compile=compiled, mosaic_buffer=0, close_mosaic=1,
                          out=str(tmp_path / f"run{int(compiled)}"))
        Trainer(cfg).fit()
        rows[compiled] = list(csv.DictReader((tmp_path / f"run{int(compiled)}" / "results.csv").open()))
        assert len(compiled_nets) == 2 * int(compiled)   # the second run trained a compiled network and loss
    for eager, comp in zip(rows[False], rows[True], strict=True):
        for k in ("train/box", "train/cls", "train/dfl", "lr", "steps"):
            assert float(comp[k]) == pytest.approx(float(eager[k]), rel=1e-4), k


@pytest.mark.gpu
@pytest.mark.parametrize("name, precision, optimizer", [("yolov8n", "bf16", "sgd"), ("yolov3-tiny", "fp16", "sgd"),
                                                        ("yolo26n.yaml", "bf16", "musgd")])
def test_a_cuda_training_step_never_waits_for_the_device(name, precision, optimizer):
    """Forward, loss, backward and the optimizer step (unscale, clip, skip-on-inf) of a COCO-like
    batch (8 images of 60 boxes) under ``torch.cuda.set_sync_debug_mode("error")``; a first step
    builds the caches (grids, anchors, the assigner's chunk size) and cuDNN's plans."""
    from yolokit.accel.amp import Precision
    from yolokit.models import create_model
    from yolokit.train.build import build_loss
    from yolokit.train.optim import build_optimizer
    from yolokit.train.step import forward_backward

    device, g = torch.device("cuda"), 60
    model = create_model(name, num_classes=80).to(device).train()
    criterion = build_loss(model, TrainConfig(model=name))
    amp = Precision(precision, device)
    optimizer = build_optimizer(model, optimizer, 0.01, 0.9, 5e-4)   # MuSGD: Newton-Schulz in bfloat16
    gen = torch.Generator().manual_seed(0)
    images = torch.rand(8, 3, 320, 320, generator=gen).to(device)
    xy = torch.rand(8 * g, 2, generator=gen) * 280
    boxes = torch.cat([xy, xy + 8 + torch.rand(8 * g, 2, generator=gen) * 32], 1)
    targets = torch.cat([torch.arange(8).repeat_interleave(g)[:, None].float(),
                         torch.randint(0, 80, (8 * g, 1), generator=gen).float(), boxes], 1).to(device)

    def step():
        forward_backward(model, criterion, amp, images, targets, max_boxes=g, weight=8.0, channels_last=False)
        amp.step(optimizer, clip_grad_norm=10.0, blocking=False)
        optimizer.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("name, optimizer", [("yolov8n", "sgd"), ("yolov3-tiny", "sgd"), ("yolo11n.yaml", "sgd"),
                                             ("yolo26n.yaml", "musgd")])
def test_a_step_reads_no_uninitialised_memory(name, optimizer):
    """The CPU stand-in for ``compute-sanitizer --tool initcheck`` on the step (which does not finish
    one in its time on a GPU): with torch's ``fill_uninitialized_memory`` every ``torch.empty``
    comes filled with NaN or the largest integer, so a read of memory nothing wrote changes the
    loss, a gradient or the updated weights. Forward, loss, backward, the optimizer step and the
    EMA update give the same numbers, bit for bit, filled or not."""
    import torch.utils.deterministic as det

    from yolokit.accel.amp import Precision
    from yolokit.models import create_model
    from yolokit.train.build import build_loss
    from yolokit.train.ema import ModelEMA
    from yolokit.train.optim import build_optimizer
    from yolokit.train.step import forward_backward

    gen = torch.Generator().manual_seed(0)
    images = torch.rand(2, 3, 64, 64, generator=gen)
    xy = torch.rand(9, 2, generator=gen) * 40
    targets = torch.cat([torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1.0])[:, None], torch.randint(0, 80, (9, 1),
                         generator=gen).float(), xy, xy + 8 + torch.rand(9, 2, generator=gen) * 16], 1)
    results = []
    for fill in (False, True):
        torch.manual_seed(0)
        model = create_model(name, num_classes=80).train()
        ema = ModelEMA(model)
        criterion = build_loss(model, TrainConfig(model=name))
        amp = Precision("fp32", torch.device("cpu"))
        opt = build_optimizer(model, optimizer, 0.01, 0.9, 5e-4)
        torch.use_deterministic_algorithms(True)
        det.fill_uninitialized_memory = fill
        try:
            loss, parts = forward_backward(model, criterion, amp, images, targets, max_boxes=5, weight=2.0,
                                           channels_last=True)
            grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
            amp.step(opt, clip_grad_norm=10.0, blocking=False)
            opt.zero_grad(set_to_none=True)
            ema.update(model)
        finally:
            torch.use_deterministic_algorithms(False)
            det.fill_uninitialized_memory = False
        results.append((loss, grads, [t.clone() for t in ema.module.state_dict().values()]))
    (loss_a, grads_a, ema_a), (loss_b, grads_b, ema_b) = results
    assert torch.isfinite(loss_b) and torch.equal(loss_a, loss_b)
    assert len(grads_a) == len(grads_b) > 0 and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(ema_a, ema_b, strict=True))
