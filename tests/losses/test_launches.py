"""The losses are not launch-bound: the operations one call dispatches do not grow with the boxes.

On a GPU every dispatched operation is a kernel launch of a few microseconds, so a loss whose
operation count grows with the boxes per image is slow on COCO-like batches whatever the GPU.
The count is taken on the CPU, under ``FakeTensorMode`` (shapes only, no arithmetic), at 64
images of 640 px with 10 and with 100 boxes each, the assigner's chunk sized as on a GPU with
70 GiB free. Stated bounds: YOLOv8's call stays under 1,000 operations and 100 boxes cost at
most one more chunk (200 operations) than 10; YOLOv3's count does not change at all.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import yolokit
from yolokit.losses import YOLOv3Loss, YOLOv8Loss
from yolokit.losses.assigners import chunk_pairs_for

BATCH, IMGSZ = 64, 640


class OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def targets(boxes_per_image: int, batch: int = BATCH) -> torch.Tensor:
    g = torch.Generator().manual_seed(boxes_per_image)
    n = batch * boxes_per_image
    xy = torch.rand(n, 2, generator=g) * (IMGSZ - 64)
    wh = 8 + torch.rand(n, 2, generator=g) * 56
    image = torch.arange(batch).repeat_interleave(boxes_per_image).float()[:, None]
    cls = torch.randint(0, 80, (n, 1), generator=g).float()
    return torch.cat([image, cls, xy, xy + wh], 1)


def dispatched(loss: torch.nn.Module, channels: int, boxes_per_image: int, batch: int = BATCH) -> int:
    """Operations one loss call dispatches (shapes only: no arithmetic is done)."""
    t = targets(boxes_per_image, batch)
    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        maps = [torch.randn(batch, channels, IMGSZ // s, IMGSZ // s) for s in (8, 16, 32)]
        count = OpCount()
        with count:
            loss(maps, fake.from_tensor(t), max_boxes=boxes_per_image)
    return count.ops


@pytest.fixture(scope="module")
def v8_loss():
    model = yolokit.create_model("yolov8n", num_classes=80)
    loss = YOLOv8Loss(80, model.head.strides, reg_max=model.head.reg_max)
    loss.assigner.chunk_pairs = chunk_pairs_for(torch.device("cuda"), free_bytes=70 * 2**30)
    return loss


def test_the_gpu_chunk_makes_a_coco_batch_a_few_chunks():
    pairs = chunk_pairs_for(torch.device("cuda"), free_bytes=70 * 2**30)
    assert -(-BATCH * 100 * 8400 // pairs) <= 2                         # 64 x 100 boxes x 8,400 points
    assert chunk_pairs_for(torch.device("cuda"), free_bytes=2**28) == 2**18   # little free memory: the floor
    assert chunk_pairs_for(torch.device("cpu")) == 2**18


def test_yolov8_loss_launches_do_not_grow_with_the_boxes(v8_loss):
    few, many = dispatched(v8_loss, 144, 10), dispatched(v8_loss, 144, 100)
    assert many < 1000 and many - few <= 200, (few, many)


def test_the_old_cpu_chunk_was_launch_bound(v8_loss):
    """What the bound guards against: at 2^18 pairs a chunk (16 images here), 100 boxes per image
    cost several times the launches of 10."""
    small = YOLOv8Loss(80, v8_loss.strides, reg_max=16)
    small.assigner.chunk_pairs = 2**18
    assert dispatched(small, 144, 100, batch=16) > 3 * dispatched(small, 144, 10, batch=16)


def test_yolov3_loss_launches_do_not_grow_with_the_boxes():
    model = yolokit.create_model("yolov3", num_classes=80)
    loss = YOLOv3Loss(80, model.head.anchors, model.head.strides)
    dispatched(loss, 255, 10)                      # the first call builds its constants (then cached)
    few, many = dispatched(loss, 255, 10), dispatched(loss, 255, 100)
    assert few == many, (few, many)
