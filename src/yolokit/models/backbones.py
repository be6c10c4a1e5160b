"""Backbones: Darknet-53 and Darknet-tiny (YOLOv3) and the CSP backbone of YOLOv8.

Each backbone returns a list of feature maps in increasing stride order and describes
them through ``out_channels`` and ``strides``, so necks read channel counts from it.
Its ``stages`` are the units activation checkpointing may wrap.
"""

from __future__ import annotations

from torch import Tensor, nn

from yolokit.models.layers import DARKNET_STYLE, SPPF, V8_STYLE, C2f, Conv, DarknetResidual, MaxPoolSame


def _last_three(x: Tensor, stages: nn.ModuleList) -> list[Tensor]:
    """Runs the stages in turn and returns the outputs of the last three (strides 8, 16, 32)."""
    outs = []
    for stage in stages:
        x = stage(x)
        outs.append(x)
    return outs[-3:]


class Darknet53(nn.Module):
    """Darknet-53: a 3x3 stem, then five stages of (stride-2 conv, n residual units).

    Returns the outputs of the last three stages (strides 8, 16, 32; 256, 512, 1024
    channels at width 1).
    """

    def __init__(self, *, depths: tuple[int, ...] = (1, 2, 8, 8, 4), base: int = 32):
        super().__init__()
        self.stem = Conv(3, base, 3, style=DARKNET_STYLE)
        stages, c = [], base
        for n in depths:
            stages.append(nn.Sequential(Conv(c, 2 * c, 3, 2, style=DARKNET_STYLE),
                                        *(DarknetResidual(2 * c) for _ in range(n))))
            c *= 2
        self.stages = nn.ModuleList(stages)
        self.out_channels = (c // 4, c // 2, c)
        self.strides = (8, 16, 32)

    def forward(self, x: Tensor) -> list[Tensor]:
        return _last_three(self.stem(x), self.stages)


class DarknetTiny(nn.Module):
    """The yolov3-tiny backbone: six 3x3 convs with max-pools, then a 3x3 1024 conv.

    Stage layout (Darknet layer order): conv16, pool, conv32, pool, conv64, pool, conv128,
    pool, conv256 (stride 16, output 1) | pool, conv512, size-2 stride-1 pool, conv1024
    (stride 32, output 2).
    """

    def __init__(self):
        super().__init__()
        def conv(c1: int, c2: int) -> Conv:
            return Conv(c1, c2, 3, style=DARKNET_STYLE)

        def pool() -> nn.MaxPool2d:
            return nn.MaxPool2d(2, 2)

        self.stages = nn.ModuleList([
            nn.Sequential(conv(3, 16), pool(), conv(16, 32), pool(), conv(32, 64), pool(),
                          conv(64, 128), pool(), conv(128, 256)),
            nn.Sequential(pool(), conv(256, 512), MaxPoolSame(2), conv(512, 1024)),
        ])
        self.out_channels = (256, 1024)
        self.strides = (16, 32)

    def forward(self, x: Tensor) -> list[Tensor]:
        p4 = self.stages[0](x)
        return [p4, self.stages[1](p4)]


class CSPDarknet(nn.Module):
    """YOLOv8 backbone: a stride-2 stem conv, four stages of (stride-2 conv, C2f), SPPF.

    Args:
        widths: output channels of the stem and the four stages (already scaled).
        depths: bottlenecks in each stage's C2f (already scaled).

    Returns the outputs of stages 2, 3 and 4 (strides 8, 16, 32); stage 4 ends in SPPF.
    """

    def __init__(self, *, widths: tuple[int, int, int, int, int], depths: tuple[int, int, int, int]):
        super().__init__()
        self.stem = Conv(3, widths[0], 3, 2, style=V8_STYLE)
        stages = []
        for i, n in enumerate(depths):
            c1, c2 = widths[i], widths[i + 1]
            blocks = [Conv(c1, c2, 3, 2, style=V8_STYLE), C2f(c2, c2, n, shortcut=True, style=V8_STYLE)]
            if i == len(depths) - 1:
                blocks.append(SPPF(c2, c2, 5, style=V8_STYLE))
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.ModuleList(stages)
        self.out_channels = tuple(widths[2:])
        self.strides = (8, 16, 32)

    def forward(self, x: Tensor) -> list[Tensor]:
        return _last_three(self.stem(x), self.stages)
