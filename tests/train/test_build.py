"""Building a run: the loss follows the head, the model comes from where the run says."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import yolokit
from yolokit.losses import YOLOv3Loss, YOLOv8Loss
from yolokit.models import Detector
from yolokit.models.heads import DFLHead
from yolokit.train import TrainConfig
from yolokit.train.build import build_loss
from yolokit.train.config import check_model_name

TARGETS = torch.tensor([[0, 1, 8.0, 8.0, 40.0, 40.0], [1, 0, 20.0, 4.0, 60.0, 30.0]])


@pytest.mark.parametrize("name, loss_type, strides", [
    ("yolov8n", YOLOv8Loss, (8, 16, 32)),
    ("yolov3-tiny", YOLOv3Loss, (16, 32)),
    ("yolov8n-p2.yaml", YOLOv8Loss, (4, 8, 16, 32)),          # four levels: the loss at the head's four strides
    ("yolo11n.yaml", YOLOv8Loss, (8, 16, 32)),
])
def test_the_loss_follows_the_head(name, loss_type, strides):
    model = yolokit.create_model(name, num_classes=5)
    loss = build_loss(model, TrainConfig(box=1.5, cls=0.25, dfl=2.0))
    assert type(loss) is loss_type and tuple(loss.strides) == strides == model.strides
    total, parts = loss(model(torch.zeros(2, 3, 64, 64)), TARGETS)
    assert total.shape == () and torch.isfinite(total) and total > 0 and len(parts) >= 3
    if loss_type is YOLOv8Loss:
        assert loss.gains == {"box": 1.5, "cls": 0.25, "dfl": 2.0} and loss.reg_max == model.head.reg_max


def test_a_head_the_trainer_has_no_loss_for_is_named():
    class Custom(nn.Module):
        num_classes, strides = 2, (8,)

    with pytest.raises(TypeError, match="no loss for a Custom head"):
        build_loss(Detector(nn.Identity(), nn.Identity(), Custom()), TrainConfig())
    assert isinstance(yolokit.create_model("yolov8n-p6.yaml", num_classes=2).head, DFLHead)


def test_model_names_are_checked_before_anything_is_built():
    check_model_name("yolov8s")
    check_model_name("path/to/my-net.yaml")                  # read when the run builds it
    check_model_name("yolo26n")                              # a packaged YAML's name at a scale, as the reference's
    check_model_name("yolo11s-seg")
    with pytest.raises(ValueError, match=r"unknown model 'yolov9s'; available: yolov3, .*yolo11\.yaml"):
        check_model_name("yolov9s")


@pytest.mark.parametrize("compile, mode", [("reduce-overhead", "reduce-overhead"), (True, "default")])
def test_the_compile_mode_reaches_torch_compile(tmp_path, monkeypatch, compile, mode):
    from yolokit.data import make_shapes
    from yolokit.train.build import build_run

    seen, real = [], torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: (seen.append(kw), real(model, **kw))[1])   # lazy
    data = make_shapes(tmp_path / "set", n_train=4, n_val=2, imgsz=64)
    built = build_run(TrainConfig(data=str(data), imgsz=64, batch=2, workers=0, plots=False, compile=compile,
                                  out=str(tmp_path / "run")), user_callbacks=[])
    assert seen == [{"mode": mode, "backend": "inductor"},                      # the network, then its loss
                    {"mode": None, "backend": "inductor", "dynamic": True}]
    assert built.parts.criterion._orig_mod.__class__.__name__ == "YOLOv8Loss"
    assert "compile=on" in built.summary["layout"]          # the run's first lines say what it trains
    assert any(n.startswith("torch.compile compiles the training network and its loss on the first step")
               for n in built.summary["notes"])


@pytest.mark.extended   # 60 s of tracing here
def test_the_compiled_loss_equals_the_eager_loss_for_any_max_boxes():
    """The trainer's compiled loss (dynamic sizes; aot_eager: the graph inductor compiles, eager kernels)
    gives the eager loss and gradients to rounding (the graph's decompositions round differently:
    measured 1e-7 of each gradient's norm), for batches of other box counts."""
    torch.manual_seed(0)
    model = yolokit.create_model("yolov8n", num_classes=3).train()
    loss = build_loss(model, TrainConfig())
    compiled = torch.compile(loss, dynamic=True, fullgraph=True, backend="aot_eager")
    for boxes in (2, 5):
        maps = [m.detach().requires_grad_() for m in model(torch.rand(3, 3, 64, 64))]
        t = torch.cat([torch.arange(3).repeat_interleave(boxes)[:, None].float(), torch.zeros(3 * boxes, 1),
                       torch.rand(3 * boxes, 2) * 30, 32 + torch.rand(3 * boxes, 2) * 30], 1)
        (want, _), (got, _) = loss(maps, t, max_boxes=boxes), compiled(maps, t, max_boxes=boxes)
        assert abs(got.item() - want.item()) <= 1e-6 * abs(want.item()) and want.item() > 0
        grads = [torch.autograd.grad(x, maps) for x in (want, got)]
        assert all(float((b - a).norm() / a.norm()) < 1e-5 for a, b in zip(*grads, strict=True))


@pytest.mark.parametrize("floor, steps", [(100, 100), (0, 4)])
def test_the_warmup_floor_reaches_the_schedule(tmp_path, floor, steps):
    """warmup_min_steps: 2 steps an epoch, 2 warmup epochs: 4 steps, or the 100-step floor."""
    from yolokit.data import make_shapes
    from yolokit.train.build import build_run

    data = make_shapes(tmp_path / "set", n_train=4, n_val=2, imgsz=64)
    built = build_run(TrainConfig(data=str(data), imgsz=64, batch=2, nbs=2, workers=0, plots=False, warmup_epochs=2,
                                  warmup_min_steps=floor, model="yolov8n", out=str(tmp_path / "run")),
                      user_callbacks=[])
    assert built.parts.schedule.warmup_iters == steps


def test_a_packaged_yamls_plain_name_builds_what_its_yaml_name_builds():
    """``yolo26n`` (what a user of the reference types) is ``yolo26n.yaml``: the same network, name and scale;
    a built-in name stays the built-in variant, and a name no packaged YAML has stays an error."""
    from yolokit.models.zoo import packaged_model

    for name in ("yolo26n", "yolo11s", "yolov8n-p2"):
        plain, file = yolokit.create_model(name, num_classes=3), yolokit.create_model(f"{name}.yaml", num_classes=3)
        assert plain.name == file.name == name
        assert [tuple(p.shape) for p in plain.parameters()] == [tuple(p.shape) for p in file.parameters()]
    assert sum(p.numel() for p in yolokit.create_model("yolo26n", num_classes=4).parameters()) == 2_505_360
    assert packaged_model("yolov8n") is None and packaged_model("my/yolo26n") is None
    with pytest.raises(ValueError, match=r"unknown model 'yolo27n'.*a packaged model YAML's name at a scale"):
        yolokit.create_model("yolo27n")


def test_min_gt_side_reaches_every_assigner_and_gives_a_tiny_box_its_points():
    """``TrainConfig.min_gt_side``: the reference 8.4's widening of small GTs for the inside test, one switch."""
    model = yolokit.create_model("yolov8n", num_classes=2)
    tiny = torch.tensor([[0, 1, 13.0, 13.0, 15.0, 15.0]])      # between the centres of every level (8, 16, 32)
    maps = model(torch.zeros(1, 3, 64, 64))
    plain, wide = build_loss(model, TrainConfig()), build_loss(model, TrainConfig(min_gt_side=16))
    assert (plain.assigner.min_gt_side, wide.assigner.min_gt_side) == (0.0, 16.0)
    positives = [int(loss._terms(maps, tiny, None)[1].positive.sum()) for loss in (plain, wide)]
    assert positives[0] == 0 and positives[1] > 0                   # no point inside / some, in the widened box
    e2e = yolokit.create_model("yolo26n", num_classes=2)
    assert build_loss(e2e, TrainConfig()).one2one.assigner.min_gt_side == 16.0     # YOLO26's own
    assert build_loss(e2e, TrainConfig(min_gt_side=0)).one2many.assigner.min_gt_side == 0.0
    seg = build_loss(yolokit.create_model("yolov8n-seg", num_classes=2), TrainConfig(min_gt_side=8))
    assert seg.assigner.min_gt_side == 8.0
    with pytest.raises(ValueError, match="min_gt_side 16: a YOLOv3 anchor head"):
        build_loss(yolokit.create_model("yolov3-tiny", num_classes=2), TrainConfig(min_gt_side=16))
    with pytest.raises(ValueError, match="min_gt_side must be >= 0"):
        TrainConfig(min_gt_side=-1)
