"""The blocks model YAMLs add: each against its formula written out here."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from yolokit.models.attention import C2PSA, Attention, PSABlock
from yolokit.models.csp import C2, C3, C3k, C3k2
from yolokit.models.layers import SPP, SPPF, Bottleneck, Concat, Conv, DWConv, Index


def randomized(module, seed=0):
    """Eval mode with non-trivial batch-norm statistics, so that every term shows in the output."""
    g = torch.Generator().manual_seed(seed)
    for m in module.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    return module.eval()


def test_conv_padding_dilation_groups_and_no_activation():
    conv = Conv(4, 8, 3, 2, None, d=2, g=2, act=False)
    assert conv.conv.padding == (2, 2) and conv.conv.dilation == (2, 2) and conv.conv.groups == 2
    assert isinstance(conv.act, nn.Identity)
    assert Conv(3, 8, 6, 2, 2)(torch.zeros(1, 3, 64, 64)).shape == (1, 8, 32, 32)   # YOLOv5's stem
    dw = DWConv(8, 16, 3)
    assert dw.conv.groups == 8 and isinstance(dw, Conv) and isinstance(dw.act, nn.SiLU)


def test_concat_and_index():
    a, b = torch.rand(1, 2, 4, 4), torch.rand(1, 3, 4, 4)
    assert torch.equal(Concat(1)([a, b]), torch.cat([a, b], 1))
    assert Index(1)([a, b]) is b


def test_c2_and_c3_follow_their_formulas():
    x = torch.randn(1, 16, 8, 8)
    c2 = randomized(C2(16, 32, 2, shortcut=True))
    a, b = c2.cv1(x).chunk(2, 1)
    torch.testing.assert_close(c2(x), c2.cv2(torch.cat((c2.m(a), b), 1)))
    assert len(c2.m) == 2 and all(blk.add and blk.cv1.conv.kernel_size == (3, 3) for blk in c2.m)
    c3 = randomized(C3(16, 32, 3, shortcut=False))
    torch.testing.assert_close(c3(x), c3.cv3(torch.cat((c3.m(c3.cv1(x)), c3.cv2(x)), 1)))
    assert [blk.cv1.conv.kernel_size[0] for blk in c3.m] == [1, 1, 1] and not any(blk.add for blk in c3.m)
    assert [blk.cv1.conv.kernel_size[0] for blk in C3k(16, 16, 2).m] == [3, 3]


@pytest.mark.parametrize("c3k,attn,inner", [(False, False, Bottleneck), (True, False, C3k),
                                            (False, True, nn.Sequential)])
def test_c3k2_inner_blocks_and_forward(c3k, attn, inner):
    block = randomized(C3k2(32, 64, 2, c3k=c3k, attn=attn, expansion=0.5))
    assert block.hidden == 32 and len(block.m) == 2 and all(type(m) is inner for m in block.m)
    if inner is Bottleneck:
        assert block.m[0].cv1.conv.out_channels == 16   # the bottleneck's own expansion 0.5
    if attn:
        assert isinstance(block.m[0][1], PSABlock) and block.m[0][1].attn.num_heads == 1
    x = torch.randn(2, 32, 8, 8)
    pieces = list(block.cv1(x).chunk(2, 1))
    for m in block.m:
        pieces.append(m(pieces[-1]))
    torch.testing.assert_close(block(x), block.cv2(torch.cat(pieces, 1)))


def test_attention_equals_softmax_attention_written_out():
    attn = randomized(Attention(64, num_heads=2, attn_ratio=0.5))
    assert (attn.head_dim, attn.key_dim) == (32, 16) and attn.qkv.conv.out_channels == 64 + 2 * 2 * 16
    x = torch.randn(2, 64, 5, 6)
    b, c, h, w = x.shape
    q, k, v = attn.qkv(x).view(b, 2, 16 + 16 + 32, h * w).split((16, 16, 32), dim=2)
    scores = (q.transpose(-2, -1) @ k) / math.sqrt(16)   # [B, heads, HW, HW]
    mixed = (v @ scores.softmax(-1).transpose(-2, -1)).reshape(b, c, h, w)
    expected = attn.proj(mixed + attn.pe(v.reshape(b, c, h, w)))
    torch.testing.assert_close(attn(x), expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="not a multiple"):
        Attention(60, num_heads=8)


def test_psa_block_and_c2psa():
    block = randomized(PSABlock(64, num_heads=1))
    x = torch.randn(1, 64, 4, 4)
    y = x + block.attn(x)
    torch.testing.assert_close(block(x), y + block.ffn(y))
    assert isinstance(block.ffn[1].act, nn.Identity)
    c2psa = randomized(C2PSA(256, 256, 2))
    assert c2psa.hidden == 128 and all(m.attn.num_heads == 2 for m in c2psa.m)
    x = torch.randn(1, 256, 4, 4)
    a, b = c2psa.cv1(x).split((128, 128), 1)
    torch.testing.assert_close(c2psa(x), c2psa.cv2(torch.cat((a, c2psa.m(b)), 1)))
    with pytest.raises(ValueError, match="keeps its channels"):
        C2PSA(256, 128)


def test_spp_with_convolutions_pools_in_kernel_order():
    spp = randomized(SPP(16, 24, (5, 9, 13)))
    x = torch.randn(1, 16, 13, 13)
    y = spp.cv1(x)
    expected = spp.cv2(torch.cat([y] + [F.max_pool2d(y, k, 1, k // 2) for k in (5, 9, 13)], 1))
    torch.testing.assert_close(spp(x), expected)
    assert spp.cv1.conv.out_channels == 8 and spp.cv2.conv.in_channels == 32


def test_sppf_newer_form():
    sppf = randomized(SPPF(16, 16, 5, n=2, shortcut=True, cv1_act=False))
    x = torch.randn(1, 16, 9, 9)
    y = sppf.cv1(x)
    assert isinstance(sppf.cv1.act, nn.Identity)
    p1 = F.max_pool2d(y, 5, 1, 2)
    torch.testing.assert_close(sppf(x), x + sppf.cv2(torch.cat([y, p1, F.max_pool2d(p1, 5, 1, 2)], 1)))
