"""rect and multi_scale in real runs: what reaches the network, step by step, and on two ranks.

A spy sees each micro-batch twice: as the loader gave it (after ``to_device``) and as the
network gets it (the tensors handed to ``forward_backward``); optimizer steps mark where the
micro-batches of one step end. Exact resume of both is in test_resume_iters.py.
"""

from __future__ import annotations

import math

import _train_workers as workers
import pytest
import torch
import torch.nn.functional as F

import yolokit.train.step as step_module
from yolokit.accel.launcher import launch
from yolokit.data import make_shapes
from yolokit.train import TrainConfig, Trainer
from yolokit.train.scales import step_size

# no torchrun variables: one process unless told; launch() forks the ranks (conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clean_env", "forked_ranks")]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return str(make_shapes(tmp_path_factory.mktemp("shapes") / "set", n_train=12, n_val=2, imgsz=64))


@pytest.fixture(scope="module")
def shapes128(tmp_path_factory):
    """128 px: the smallest size whose rect shapes are not all square at stride 32 (64 x 43 pads to 64 x 64)."""
    return str(make_shapes(tmp_path_factory.mktemp("shapes128") / "set", n_train=12, n_val=2, imgsz=128))


def tiny(data, out, **kw) -> TrainConfig:
    base = dict(data=data, imgsz=64, batch=2, nbs=4, epochs=2, workers=0, out=str(out), plots=False,
                warmup_epochs=0.0, close_mosaic=1, seed=5, mosaic_buffer=0)
    return TrainConfig(**{**base, **kw})


class Spy:
    """Per optimizer step, each micro-batch: (indices, loader images, loader targets, net images, net targets)."""

    def __init__(self, monkeypatch):
        self.steps: list[list[tuple]] = [[]]
        self.hsv_tables: list[bool] = []          # per loaded batch: did it leave the HSV step to to_device
        to_device, forward_backward = step_module.to_device, step_module.forward_backward
        after_step = Trainer.after_step

        def loaded(batch, device, **kw):
            out = to_device(batch, device, **kw)
            self.hsv_tables.append("hsv_lut" in batch)
            self.loaded = (batch["indices"], out["images"].clone(), out["targets"].clone())
            return out

        def fed(net, criterion, precision, images, targets, **kw):
            self.steps[-1].append((*self.loaded, images.detach().clone(), targets.clone()))
            return forward_backward(net, criterion, precision, images, targets, **kw)

        def stepped(trainer, epoch):
            after_step(trainer, epoch)
            self.steps.append([])

        monkeypatch.setattr(step_module, "to_device", loaded)
        monkeypatch.setattr(step_module, "forward_backward", fed)
        monkeypatch.setattr(Trainer, "after_step", stepped)

    def taken(self) -> list[list[tuple]]:
        return [s for s in self.steps if s]


def test_multi_scale_resizes_every_micro_batch_of_a_step_to_its_size(shapes, tmp_path, monkeypatch):
    spy = Spy(monkeypatch)
    Trainer(tiny(shapes, tmp_path / "run", multi_scale=True, hsv_on_device=True)).fit()
    steps = spy.taken()
    assert len(spy.hsv_tables) == 12 and all(spy.hsv_tables)        # HSV applied in to_device, before the resize
    assert len(steps) == 6 and all(len(s) == 2 for s in steps)      # 3 steps of 2 micro-batches per epoch
    sizes = []
    for n, micro_batches in enumerate(steps):
        size = step_size(5, n // 3, n % 3, 64, 32)                   # (seed, epoch, step in epoch) only
        for _, before, targets_before, images, targets in micro_batches:
            assert before.shape[-2:] == (64, 64) and images.shape[-2:] == (size, size)
            torch.testing.assert_close(images, F.interpolate(before, size=(size, size), mode="bilinear",
                                                             align_corners=False))
            assert torch.equal(targets[:, :2], targets_before[:, :2]) and len(targets) > 0
            torch.testing.assert_close(targets[:, 2:], targets_before[:, 2:] * (size / 64))   # boxes follow
        sizes.append(size)
    assert len(set(sizes)) > 1 and set(sizes) <= {32, 64, 96}


def _rect_shape(h, w, imgsz=128, stride=32):
    r = imgsz / max(h, w)
    return math.ceil(round(h * r) / stride) * stride, math.ceil(round(w * r) / stride) * stride


def test_rect_training_feeds_aspect_batches_and_multi_scale_scales_their_long_side(shapes128, tmp_path,
                                                                                  monkeypatch):
    from yolokit.data import DetectionDataset

    spy = Spy(monkeypatch)
    Trainer(tiny(shapes128, tmp_path / "run", imgsz=128, epochs=1, rect=True, multi_scale=True)).fit()
    original = DetectionDataset(shapes128, "train", imgsz=128).shapes
    steps, shapes = spy.taken(), set()
    assert len(steps) == 3 and sum(len(s) for s in steps) == 6
    for k, micro_batches in enumerate(steps):
        size = step_size(5, 0, k, 128, 32)
        for indices, before, targets_before, images, targets in micro_batches:
            h, w = before.shape[-2:]
            own = [_rect_shape(*original[i]) for i in indices]
            assert (h, w) == tuple(max(s[d] for s in own) for d in (0, 1))   # the batch's rect shape, to the net
            shapes.add((h, w))
            nh, nw = (size if side == max(h, w) else max(32, round(side * size / max(h, w) / 32) * 32)
                      for side in (h, w))
            assert images.shape[-2:] == (nh, nw) and nh % 32 == 0 and nw % 32 == 0
            gain = torch.tensor([nw / w, nh / h] * 2)
            torch.testing.assert_close(targets[:, 2:], targets_before[:, 2:] * gain)
    assert any(h != w for h, w in shapes)                               # not all square


def test_two_ranks_draw_the_same_size_for_each_step(shapes, tmp_path):
    """batch 4 (2 per rank), nbs 8: each step is 2 micro-batches per rank; 12 images make 2 steps an epoch."""
    cfg = tiny(shapes, tmp_path / "run", batch=4, nbs=8, multi_scale=True)
    ranks = launch(workers.fit_recording_sizes, 2, cfg, timeout=300)
    assert [r["rank"] for r in ranks] == [0, 1]
    steps = [r["steps"] for r in ranks]
    assert len(steps[0]) == len(steps[1]) == 4
    expected = [step_size(5, n // 2, n % 2, 64, 32) for n in range(4)]
    for n, size in enumerate(expected):
        mine = [s[n] for s in steps]
        assert mine[0] and all(m == [(size, size)] * len(m) for m in mine if m)   # every micro-batch, every rank
    assert [len(s[0]) for s in steps] == [2, 2] and len(set(expected)) > 1
