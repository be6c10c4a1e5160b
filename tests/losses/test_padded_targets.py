"""Losses take targets already padded per image (PaddedTargets), as a CUDA graph's static shapes need."""

import pytest
import torch

from yolokit.losses import YOLO26Loss, YOLOv3Loss, YOLOv8Loss
from yolokit.losses.base import PaddedTargets, pad_targets

TARGETS = torch.tensor([[0, 1, 8, 8, 40, 30.0], [1, 2, 3, 3, 60, 50], [1, 0, 10, 12, 20, 30], [1, 1, 30, 5, 62, 40]])


def _maps(channels: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, channels, s, s, generator=g).requires_grad_() for s in (8, 4, 2)]


def _grads(loss, maps):
    return torch.autograd.grad(loss, maps)


@pytest.mark.parametrize("slots", [3, 8, 32])
def test_yolov8_loss_on_padded_targets_equals_the_rows(slots):
    """Bit for bit at the rows' own G; more slots (a graph's bucket) add rows of weight 0, which sum in
    another order: equal within float32 rounding."""
    loss_fn = YOLOv8Loss(3, (8, 16, 32))
    maps = _maps(64 + 3)
    rows, parts = loss_fn(maps, TARGETS, max_boxes=3)
    padded, padded_parts = loss_fn(maps, pad_targets(TARGETS, 3, max_boxes=slots))   # image 2 has no box
    grads = list(zip(_grads(rows, maps), _grads(padded, maps), strict=True))
    if slots == 3:
        assert torch.equal(rows, padded)
        assert all(torch.equal(parts[k], padded_parts[k]) for k in parts)
        assert all(torch.equal(a, b) for a, b in grads)
    else:
        torch.testing.assert_close(padded, rows, rtol=1e-6, atol=0)
        for k in parts:
            torch.testing.assert_close(padded_parts[k], parts[k], rtol=1e-6, atol=0)
        for a, b in grads:
            assert (a - b).norm() <= 1e-6 * a.norm()


def test_yolo26_loss_passes_padded_targets_to_both_branches():
    loss_fn = YOLO26Loss(3, (8, 16, 32))
    maps = {k: _maps(4 + 3, seed=i) for i, k in enumerate(("one2many", "one2one"))}
    rows, _ = loss_fn(maps, TARGETS, max_boxes=3)
    padded, _ = loss_fn(maps, pad_targets(TARGETS, 3, max_boxes=16))
    torch.testing.assert_close(padded, rows, rtol=1e-6, atol=0)
    assert loss_fn.baked_numbers() == pytest.approx((0.8, 0.2))


@pytest.mark.parametrize("box", ["ciou", "mse"])
def test_yolov3_loss_on_padded_targets_equals_the_rows(box):
    """Padding rows (zero boxes) match an anchor like any row and weigh 0 at every level: the rows' loss
    within rounding, and no NaN from a zero box."""
    loss_fn = YOLOv3Loss(3, anchors=[[(10, 13), (16, 30)], [(30, 61), (62, 45)], [(116, 90), (156, 198)]],
                         strides=(8, 16, 32), box=box)
    maps = _maps(2 * 8)
    rows, parts = loss_fn(maps, TARGETS, max_boxes=3)
    padded, padded_parts = loss_fn(maps, pad_targets(TARGETS, 3, max_boxes=16))
    torch.testing.assert_close(padded, rows, rtol=1e-6, atol=0)
    for k in parts:
        torch.testing.assert_close(padded_parts[k], parts[k], rtol=1e-6, atol=0)
    for a, b in zip(_grads(rows, maps), _grads(padded, maps), strict=True):
        assert torch.isfinite(b).all() and (a - b).norm() <= 1e-6 * a.norm()


def test_padded_targets_are_checked():
    loss_fn = YOLOv8Loss(3, (8, 16, 32))
    padded = pad_targets(TARGETS, 2, max_boxes=8)          # for 2 images, the maps hold 3
    with pytest.raises(ValueError, match="PaddedTargets for 3 images"):
        loss_fn(_maps(64 + 3), padded)
    with pytest.raises(ValueError, match="PaddedTargets for 3 images"):
        loss_fn(_maps(64 + 3), PaddedTargets(*(t[:, :4] for t in pad_targets(TARGETS, 3, max_boxes=8)[:2]),
                                            torch.zeros(3, 5, dtype=torch.bool)))
