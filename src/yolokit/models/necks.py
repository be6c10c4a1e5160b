"""Necks: YOLOv3's FPN (full, SPP and tiny forms) and YOLOv8's PAN.

A neck takes the backbone's feature maps (increasing stride) and returns the maps the
head reads, same count and strides, with channels given by ``out_channels``. Where an
upsampled map meets a backbone map, the upsampled one comes first in the concatenation.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from yolokit.models.layers import DARKNET_STYLE, V8_STYLE, C2f, Conv, DarknetSPP


def _dn(c1: int, c2: int, k: int) -> Conv:
    return Conv(c1, c2, k, style=DARKNET_STYLE)


def _darknet_block(c_in: int, c: int, *, spp: bool = False) -> nn.Sequential:
    """Five alternating 1x1 (c) / 3x3 (2c) convs; the SPP form inserts SPP + a 1x1 after the third."""
    layers: list[nn.Module] = [_dn(c_in, c, 1), _dn(c, 2 * c, 3), _dn(2 * c, c, 1)]
    if spp:
        layers += [DarknetSPP((5, 9, 13)), _dn(4 * c, c, 1)]
    layers += [_dn(c, 2 * c, 3), _dn(2 * c, c, 1)]
    return nn.Sequential(*layers)


class YOLOv3FPN(nn.Module):
    """The YOLOv3 neck, from the stride-32 level down to stride 8.

    At each level a five-conv block (``block5/4/3``) feeds a 3x3 conv whose output the
    head reads (``out5/4/3``) and, for the two coarser levels, a 1x1 lateral conv that is
    upsampled and concatenated with the next finer backbone map.

    Args:
        in_channels: backbone channels at strides 8, 16, 32.
        spp: the yolov3-spp form (SPP inside the stride-32 block).
    """

    def __init__(self, in_channels: tuple[int, int, int] = (256, 512, 1024), *, spp: bool = False):
        super().__init__()
        c3, c4, c5 = in_channels
        self.block5 = _darknet_block(c5, c5 // 2, spp=spp)
        self.out5 = _dn(c5 // 2, c5, 3)
        self.lateral5 = _dn(c5 // 2, c5 // 4, 1)
        self.block4 = _darknet_block(c5 // 4 + c4, c4 // 2)
        self.out4 = _dn(c4 // 2, c4, 3)
        self.lateral4 = _dn(c4 // 2, c4 // 4, 1)
        self.block3 = _darknet_block(c4 // 4 + c3, c3 // 2)
        self.out3 = _dn(c3 // 2, c3, 3)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.out_channels = (c3, c4, c5)

    def forward(self, features: list[Tensor]) -> list[Tensor]:
        p3, p4, p5 = features
        x5 = self.block5(p5)
        x4 = self.block4(torch.cat((self.up(self.lateral5(x5)), p4), dim=1))
        x3 = self.block3(torch.cat((self.up(self.lateral4(x4)), p3), dim=1))
        return [self.out3(x3), self.out4(x4), self.out5(x5)]


class YOLOv3TinyFPN(nn.Module):
    """The yolov3-tiny neck: two levels (strides 16 and 32).

    ``block5`` (1x1 256) feeds ``out5`` (3x3 512) and the lateral 1x1 128, which is
    upsampled, concatenated with the stride-16 backbone map and fed to ``out4`` (3x3 256).
    """

    def __init__(self, in_channels: tuple[int, int] = (256, 1024)):
        super().__init__()
        c4, c5 = in_channels
        self.block5 = _dn(c5, c5 // 4, 1)
        self.out5 = _dn(c5 // 4, c5 // 2, 3)
        self.lateral5 = _dn(c5 // 4, c5 // 8, 1)
        self.out4 = _dn(c5 // 8 + c4, c4, 3)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.out_channels = (c4, c5 // 2)

    def forward(self, features: list[Tensor]) -> list[Tensor]:
        p4, p5 = features
        x5 = self.block5(p5)
        return [self.out4(torch.cat((self.up(self.lateral5(x5)), p4), dim=1)), self.out5(x5)]


class YOLOv8PAN(nn.Module):
    """The YOLOv8 neck: a top-down path (upsample + C2f) then a bottom-up path (stride-2 conv + C2f).

    Args:
        in_channels: backbone channels at strides 8, 16, 32 (the outputs keep them).
        depth: bottlenecks in every C2f (already scaled).
    """

    def __init__(self, in_channels: tuple[int, int, int], *, depth: int):
        super().__init__()
        c3, c4, c5 = in_channels
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.top_down4 = C2f(c5 + c4, c4, depth, style=V8_STYLE)
        self.top_down3 = C2f(c4 + c3, c3, depth, style=V8_STYLE)
        self.down3 = Conv(c3, c3, 3, 2, style=V8_STYLE)
        self.bottom_up4 = C2f(c3 + c4, c4, depth, style=V8_STYLE)
        self.down4 = Conv(c4, c4, 3, 2, style=V8_STYLE)
        self.bottom_up5 = C2f(c4 + c5, c5, depth, style=V8_STYLE)
        self.out_channels = (c3, c4, c5)

    def forward(self, features: list[Tensor]) -> list[Tensor]:
        p3, p4, p5 = features
        t4 = self.top_down4(torch.cat((self.up(p5), p4), dim=1))
        n3 = self.top_down3(torch.cat((self.up(t4), p3), dim=1))
        n4 = self.bottom_up4(torch.cat((self.down3(n3), t4), dim=1))
        n5 = self.bottom_up5(torch.cat((self.down4(n4), p5), dim=1))
        return [n3, n4, n5]


def neck_units(neck: nn.Module) -> list[tuple[str, nn.Module]]:
    """The neck's blocks worth checkpointing, by name (convolution blocks, not single layers)."""
    return [(name, m) for name, m in neck.named_children() if isinstance(m, (nn.Sequential, C2f))]
