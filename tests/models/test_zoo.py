"""Contract tests over every registered model, plus the exact reference sizes."""

from dataclasses import asdict

import pytest
import torch
from torch import nn

import yolokit
from yolokit.models import build_model, config_from_dict

# Parameter counts (trainable + frozen, buffers excluded) of the reference definitions, 80 classes.
REFERENCE_PARAMETERS = {
    "yolov8n": 3_157_200,
    "yolov8s": 11_166_560,
    "yolov8m": 25_902_640,
    "yolov8l": 43_691_520,
    "yolov8x": 68_229_648,
    "yolov3": 61_949_149,
    "yolov3-spp": 62_998_749,
    "yolov3-tiny": 8_852_366,
}
NC = 3
_cache = {}


def model_for(name):
    """One small-class model per variant, built once (big variants take ~1 s to build)."""
    if name not in _cache:
        torch.manual_seed(0)
        _cache[name] = yolokit.create_model(name, num_classes=NC)
    return _cache[name]


def map_channels(model):
    if model.config.family == "yolov8":
        return [4 * model.head.reg_max + NC] * 3
    return [len(a) * (5 + NC) for a in model.head.anchors]


def test_registry_lists_every_variant():
    assert set(yolokit.list_models()) == set(REFERENCE_PARAMETERS)
    with pytest.raises(ValueError, match="yolov9"):
        yolokit.create_model("yolov9")


@pytest.mark.parametrize("name", list(REFERENCE_PARAMETERS))
def test_parameter_count_equals_reference(name):
    model = yolokit.create_model(name)
    assert sum(p.numel() for p in model.parameters()) == REFERENCE_PARAMETERS[name]


@pytest.mark.parametrize("name", yolokit.list_models())
@pytest.mark.parametrize("size", [(64, 64), (96, 128)])
def test_forward_shapes_same_in_train_and_eval(name, size):
    model = model_for(name)
    x = torch.rand(2, 3, *size)
    for train in (True, False):
        model.train(train)
        with torch.no_grad():
            maps = model(x)
        assert isinstance(maps, list) and len(maps) == len(model.strides)
        for m, s, c in zip(maps, model.strides, map_channels(model), strict=True):
            assert m.shape == (2, c, size[0] // s, size[1] // s)
    model.eval()


@pytest.mark.parametrize("name", yolokit.list_models())
def test_every_trainable_parameter_gets_a_gradient(name):
    model = model_for(name)
    model.train()
    model.zero_grad()
    maps = model(torch.rand(2, 3, 64, 64))
    g = torch.Generator().manual_seed(1)
    loss = sum((m * torch.randn(m.shape, generator=g)).mean() for m in maps)
    loss.backward()
    missing = [n for n, p in model.named_parameters()
               if p.requires_grad and (p.grad is None or p.grad.abs().sum() == 0)]
    assert not missing
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen == (["head.dfl.conv.weight"] if model.config.family == "yolov8" else [])
    model.zero_grad()
    model.eval()


def randomize_batchnorm(model):
    g = torch.Generator().manual_seed(2)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            n = m.num_features
            m.running_mean.copy_(torch.randn(n, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(n, generator=g) + 0.5)
            m.weight.data.copy_(torch.rand(n, generator=g) + 0.5)
            m.bias.data.copy_(torch.randn(n, generator=g) * 0.1)


@pytest.mark.parametrize("name", yolokit.list_models())
def test_fuse_leaves_outputs_unchanged(name):
    model = yolokit.create_model(name, num_classes=NC).eval()
    randomize_batchnorm(model)
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        before = model(x)
        model.fuse()
        after = model(x)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    convs = [m.weight for m in model.modules() if isinstance(m, nn.Conv2d) and m.kernel_size != (1, 1)]
    assert convs and all(w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous() for w in convs)
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


def test_fuse_layout_choice():
    model = yolokit.create_model("yolov8n", num_classes=NC).eval().fuse(channels_last=False)
    assert all(p.is_contiguous() for p in model.parameters())
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        plain = model(x)
        model.fuse(channels_last=True)  # already fused: only the layout changes
        for a, b in zip(plain, model(x), strict=True):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    with torch.device("meta"):
        meta = yolokit.create_model("yolov8n", num_classes=NC).fuse()  # not the CPU: layout kept
    assert meta.head.box[0][0].conv.weight.is_contiguous()


@pytest.mark.parametrize("name", yolokit.list_models())
def test_decode_shapes_and_ranges(name):
    model = model_for(name).eval()
    with torch.no_grad():
        maps = model(torch.rand(2, 3, 64, 96))
        out = model.decode(maps)
    per_level = [m.shape[-2] * m.shape[-1] for m in maps]
    anchors = [3] * len(maps) if model.config.family == "yolov3" else [1] * len(maps)
    assert out.shape == (2, sum(a * p for a, p in zip(anchors, per_level, strict=True)), 4 + NC)
    boxes, scores = out[..., :4], out[..., 4:]
    assert torch.isfinite(out).all()
    assert (scores >= 0).all() and (scores <= 1).all()
    assert (boxes[..., 2] >= boxes[..., 0]).all() and (boxes[..., 3] >= boxes[..., 1]).all()
    centres = (boxes[..., :2] + boxes[..., 2:]) / 2  # every box centre lies near its cell, inside the padded image
    assert (centres[..., 0] > -32).all() and (centres[..., 0] < 96 + 32).all()


def test_forward_rejects_sizes_that_are_not_stride_multiples():
    with pytest.raises(ValueError, match="multiples of 32"):
        model_for("yolov8n")(torch.rand(1, 3, 64, 70))


@pytest.mark.parametrize("name", yolokit.list_models())
def test_config_round_trip(name):
    model = model_for(name)
    config = config_from_dict(asdict(model.config))
    assert config == model.config
    rebuilt = build_model(config)
    assert [(k, v.shape) for k, v in rebuilt.state_dict().items()] == [
        (k, v.shape) for k, v in model.state_dict().items()]


def test_config_from_dict_rejects_unknown():
    with pytest.raises(ValueError, match="family"):
        config_from_dict({"name": "x"})
    with pytest.raises(ValueError, match="depht"):
        config_from_dict({**asdict(model_for("yolov8n").config), "depht": 1})


def test_v8_head_bias_initialisation():
    model = yolokit.create_model("yolov8s", num_classes=80)
    import math
    for box, cls, s in zip(model.head.box, model.head.cls, (8, 16, 32), strict=True):
        assert torch.all(box[-1].bias == 1.0)
        torch.testing.assert_close(cls[-1].bias, torch.full((80,), math.log(5 / 80 / (640 / s) ** 2)))
    assert model.head.dfl.conv.weight.flatten().tolist() == list(range(16))


def test_yolov8n_gflops_at_640():
    summary = yolokit.create_model("yolov8n").summary(640)
    assert summary.parameters == 3_157_200 and summary.trainable == 3_157_200 - 16
    assert summary.gflops == pytest.approx(8.7, abs=0.05)  # the published yolov8n figure
    assert "8.7 GFLOPs" in str(summary)
    assert yolokit.create_model("yolov8n").summary(320).gflops == pytest.approx(summary.gflops / 4, rel=0.01)


def test_checkpoint_units_name_real_submodules():
    model = model_for("yolov8n")
    modules = dict(model.named_modules())
    units = model.checkpoint_units("all")
    assert [n for n, _ in units][:4] == [f"backbone.stages.{i}" for i in range(4)]
    assert all(modules[n] is m for n, m in units)
    neck = [n for n, _ in model.checkpoint_units("neck")]
    assert neck == ["neck.top_down4", "neck.top_down3", "neck.bottom_up4", "neck.bottom_up5"]
    assert [n for n, _ in model_for("yolov3").checkpoint_units("neck")] == ["neck.block5", "neck.block4", "neck.block3"]
    with pytest.raises(ValueError):
        model.checkpoint_units("head")


def test_one_family_table_serves_builders_and_state_dicts():
    """Everything that depends on the family reads ``FAMILIES``: a third family would be one entry
    (the loss follows the head's type: tests/train/test_build.py)."""
    from yolokit.interop.state import config_from_state_dict
    from yolokit.models.zoo import FAMILIES, MODELS, family_of

    assert set(FAMILIES) == {c.family for c in MODELS.values()} == {"yolov8", "yolov3"}
    for name in ("yolov8n", "yolov3-tiny"):
        config = MODELS[name]
        family = family_of(config)
        assert isinstance(config, family.config) and family_of(config.family) is family
        model = yolokit.create_model(name, num_classes=5)
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        assert family.head_facts(config, shapes)["num_classes"] == 5       # the head tensors show the classes
        assert config_from_state_dict(model.state_dict()).name == name
    with pytest.raises(ValueError, match="unknown model family 'yolov5'"):
        family_of("yolov5")
    with pytest.raises(TypeError, match="expected a model config"):
        build_model(object())
