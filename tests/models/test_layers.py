import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import yolokit
from yolokit.interop.darknet import darknet_order
from yolokit.models.layers import SPPF, C2f, Conv, DarknetResidual, DarknetSPP, MaxPoolSame

DARKNET_CONVS = json.loads((Path(__file__).parent / "fixtures" / "darknet_convs.json").read_text())


def test_maxpool_same_takes_max_over_valid_window_like_darknet():
    x = torch.tensor([[[[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0], [-7.0, -8.0, -9.0]]]])
    out = MaxPoolSame(2)(x)
    # window at (i, j) covers rows i..i+1, cols j..j+1, clipped to the image: all-negative input
    # shows that no zero padding leaks in
    assert out.tolist() == [[[[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0], [-7.0, -8.0, -9.0]]]]
    y = torch.arange(9.0).view(1, 1, 3, 3)
    assert MaxPoolSame(2)(y).tolist() == [[[[4.0, 5.0, 5.0], [7.0, 8.0, 8.0], [7.0, 8.0, 8.0]]]]


def test_spp_concatenates_in_darknet_route_order():
    x = torch.randn(1, 2, 13, 13)
    out = DarknetSPP((5, 9, 13))(x)
    assert out.shape == (1, 8, 13, 13)
    torch.testing.assert_close(out[:, 0:2], F.max_pool2d(x, 13, 1, 6))
    torch.testing.assert_close(out[:, 2:4], F.max_pool2d(x, 9, 1, 4))
    torch.testing.assert_close(out[:, 4:6], F.max_pool2d(x, 5, 1, 2))
    torch.testing.assert_close(out[:, 6:8], x)


def test_sppf_equals_parallel_pools_of_5_9_13():
    sppf = SPPF(8, 8, 5).eval()
    x = torch.randn(1, 8, 12, 12)
    y = sppf.cv1(x)
    parallel = torch.cat([y] + [F.max_pool2d(y, k, 1, k // 2) for k in (5, 9, 13)], 1)
    torch.testing.assert_close(sppf(x), sppf.cv2(parallel))


def test_c2f_structure_and_residual_flag():
    block = C2f(32, 64, 2, shortcut=True)
    assert block.cv1.conv.out_channels == 64 and block.cv2.conv.in_channels == (2 + 2) * 32
    assert all(b.add for b in block.m)
    assert not any(b.add for b in C2f(32, 64, 2, shortcut=False).m)
    assert block(torch.randn(1, 32, 8, 8)).shape == (1, 64, 8, 8)


def test_darknet_residual_adds_input():
    unit = DarknetResidual(8).eval()
    x = torch.randn(1, 8, 4, 4)
    torch.testing.assert_close(unit(x), x + unit.cv2(unit.cv1(x)))
    assert isinstance(unit.cv1.act, nn.LeakyReLU) and unit.cv1.act.negative_slope == 0.1


def test_conv_fuse_is_exact_and_idempotent():
    conv = Conv(4, 6, 3, 2).eval()
    conv.bn.running_mean.uniform_(-1, 1)
    conv.bn.running_var.uniform_(0.5, 2)
    x = torch.randn(2, 4, 9, 9)
    expected = conv(x)
    conv.fuse()
    conv.fuse()
    assert isinstance(conv.bn, nn.Identity) and conv.conv.bias is not None
    torch.testing.assert_close(conv(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("act", ["silu", "leaky"])
def test_conv_activation_forces_no_copy_in_training(act):
    """An in-place SiLU makes autograd clone its input (its backward needs it); LeakyReLU's reads its output."""
    from torch.profiler import ProfilerActivity, profile

    from yolokit.models.layers import ConvStyle

    conv = Conv(4, 6, 3, style=ConvStyle(act)).train()
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        conv(x).square().sum().backward()
    names = [e.name for e in prof.events()]
    assert "aten::clone" not in names
    assert any(n.startswith(f"aten::{act}") for n in names)
    conv.act.inplace = True  # what the check guards against
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        conv(x).square().sum().backward()
    clones = sum(e.name == "aten::clone" for e in prof.events())
    assert clones == (1 if act == "silu" else 0)


def test_v8_conv_settings():
    conv = yolokit.create_model("yolov8n").backbone.stem
    assert conv.conv.bias is None and conv.bn.eps == 1e-3 and conv.bn.momentum == 0.03
    assert isinstance(conv.act, nn.SiLU)


@pytest.mark.parametrize("name", ["yolov3", "yolov3-spp", "yolov3-tiny"])
def test_yolov3_layers_follow_the_darknet_cfg(name):
    model = yolokit.create_model(name)
    ours = []
    for layer in darknet_order(model):
        conv = layer.conv if isinstance(layer, Conv) else layer
        ours.append([conv.out_channels, conv.kernel_size[0], conv.stride[0], int(isinstance(layer, Conv))])
    assert ours == DARKNET_CONVS[name]
    assert len(ours) == sum(1 for m in model.modules() if isinstance(m, Conv)) + len(model.head.preds)


def test_tiny_anchor_masks():
    head = yolokit.create_model("yolov3-tiny").head
    assert head.strides == (16, 32)
    assert head.anchors == (((23, 27), (37, 58), (81, 82)), ((81, 82), (135, 169), (344, 319)))
    full = yolokit.create_model("yolov3").head
    assert full.anchors[0] == ((10, 13), (16, 30), (33, 23)) and full.anchors[2][2] == (373, 326)
