"""Overfitting one small batch with real models: the losses must drive predictions onto boxes."""

from __future__ import annotations

import pytest
import torch

import yolokit
from yolokit.losses import YOLOv3Loss, YOLOv8Loss
from yolokit.ops.boxes import box_iou


@pytest.fixture
def one_thread():
    """One intra-op thread: on a small shared CPU this is several times faster than two."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two grey images with two coloured rectangles each (red = class 0, blue = class 1)."""
    targets = torch.tensor([[0, 0, 10, 12, 60, 50], [0, 1, 70, 60, 120, 110],
                            [1, 1, 20, 30, 50, 100], [1, 0, 64, 8, 118, 40.0]])
    targets[:, 2:] *= size / 128
    images = torch.full((2, 3, size, size), 0.5)
    colours = torch.tensor([[1.0, 0.2, 0.2], [0.1, 0.3, 1.0]])
    for i, c, x1, y1, x2, y2 in targets.long().tolist():
        images[i, :, y1:y2, x1:x2] = colours[c][:, None, None]
    return images, targets


def _overfit(name: str, size: int, steps: int, lr: float):
    torch.manual_seed(0)
    images, targets = _batch(size)
    model = yolokit.create_model(name, num_classes=2)
    head = model.head
    if name.startswith("yolov8"):
        loss_fn = YOLOv8Loss(head.num_classes, head.strides, reg_max=head.reg_max)
    else:
        loss_fn = YOLOv3Loss(head.num_classes, head.anchors, head.strides)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        total, parts = loss_fn(model(images), targets)
        optimizer.zero_grad()
        total.backward()
        optimizer.step()
        losses.append(total.item())
    # Train-mode forward: after 100 steps the batch-norm running statistics still lag.
    with torch.no_grad():
        preds = model.decode(model(images))  # [B, P, 4 + C]
    best = []
    for image, cls, *box in targets.tolist():
        p = preds[int(image)]
        top = p[:, 4 + int(cls)].argmax()
        best.append((p[top, 4 + int(cls)].item(), box_iou(p[top : top + 1, :4], torch.tensor([box]))[0, 0].item()))
    return losses, best


@pytest.mark.slow
def test_yolov8n_overfits_one_batch(one_thread):
    losses, best = _overfit("yolov8n", 128, 100, 1e-3)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[:3]) / sum(losses[-3:]) > 8
    for score, iou in best:  # the top-scoring box of each GT's class sits on the GT
        assert score > 0.5 and iou > 0.8


@pytest.mark.slow
@pytest.mark.extended   # 11 s; YOLOv3Loss matches the reference's numbers in tests/losses, yolov8n overfits here
def test_yolov3_tiny_overfits_one_batch(one_thread):
    losses, best = _overfit("yolov3-tiny", 96, 120, 2e-3)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[:3]) / sum(losses[-3:]) > 8
    for score, iou in best:
        assert score > 0.5 and iou > 0.6
