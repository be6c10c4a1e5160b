"""The shared front of the detection losses: input checks, float32 outside autocast."""

import pytest
import torch

import yolokit
from yolokit.train import TrainConfig
from yolokit.train.build import build_loss


@pytest.mark.parametrize("name", ["yolov8n", "yolov3-tiny"])
def test_bad_maps_and_targets_are_named(name):
    model = yolokit.create_model(name, num_classes=3)
    loss = build_loss(model, TrainConfig(model=name))
    maps = model(torch.rand(1, 3, 64, 64))
    good = torch.tensor([[0, 1, 4.0, 4.0, 30.0, 30.0]])
    with pytest.raises(ValueError, match=f"got {len(maps) - 1} maps for {len(maps)} strides"):
        loss(maps[:-1], good)
    wrong = [maps[0][:, :-1], *maps[1:]]
    with pytest.raises(ValueError, match=rf"Tensor\[B, {maps[0].shape[1]}, H, W\].*got \(1, {maps[0].shape[1] - 1}"):
        loss(wrong, good)
    with pytest.raises(ValueError, match=r"targets must be Tensor\[N, 6\]"):
        loss(maps, good[:, 1:])
    with pytest.raises(ValueError, match="targets are on meta but the maps on cpu.*to_device"):
        loss(maps, good.to("meta"))  # a loss moves nothing: the batch goes to the device once
    total, parts = loss(maps, good)
    assert total.dtype == torch.float32 and total.requires_grad and set(parts) <= {"box", "cls", "dfl", "obj"}


@pytest.mark.parametrize("name", ["yolov8n", "yolov3-tiny"])
def test_bf16_autocast_runs_in_float32(name):
    torch.manual_seed(3)
    model = yolokit.create_model(name, num_classes=3)
    loss = build_loss(model, TrainConfig(model=name))
    with torch.no_grad():
        maps = [(m * 0.5).bfloat16().requires_grad_() for m in model(torch.rand(2, 3, 64, 64))]
    targets = torch.tensor([[0, 0, 5, 8, 30, 40], [1, 1, 20, 10, 60, 50.0]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        total, parts = loss(maps, targets)
    assert total.dtype == torch.float32 and all(p.dtype == torch.float32 for p in parts.values())
    reference, _ = loss([m.detach().float() for m in maps], targets)
    torch.testing.assert_close(total.detach(), reference)
    total.backward()
    assert all(m.grad.dtype == torch.bfloat16 and torch.isfinite(m.grad.float()).all() for m in maps)
