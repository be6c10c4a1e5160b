"""CSP blocks of YOLOv5, YOLOv8-P6 and YOLO11 model files: C2, C3, C3k and C3k2.

Submodule names follow the common YOLO naming (``cv1``, ``cv2``, ``cv3``, ``m``), so state
dicts of model files in the community format map onto these one to one.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from yolokit.models.attention import PSABlock
from yolokit.models.layers import V8_STYLE, Bottleneck, C2f, Conv, ConvStyle


class C2(nn.Module):
    """CSP block with two convolutions: ``cv2(cat(m(a), b))`` where ``a, b`` are the halves of ``cv1(x)``.

    Args:
        c1: input channels.
        c2: output channels.
        n: bottlenecks (3x3, 3x3, expansion 1) in ``m``.
        shortcut: residual bottlenecks.
        groups: groups of each bottleneck's second convolution.
        expansion: hidden channels per half = ``int(c2 * expansion)``.
    """

    def __init__(self, c1: int, c2: int, n: int = 1, *, shortcut: bool = True, groups: int = 1,
                 expansion: float = 0.5, style: ConvStyle = V8_STYLE):
        super().__init__()
        self.hidden = int(c2 * expansion)
        self.cv1 = Conv(c1, 2 * self.hidden, 1, style=style)
        self.cv2 = Conv(2 * self.hidden, c2, 1, style=style)
        self.m = nn.Sequential(*(Bottleneck(self.hidden, self.hidden, shortcut=shortcut, expansion=1.0,
                                            groups=groups, style=style) for _ in range(n)))

    def forward(self, x: Tensor) -> Tensor:
        a, b = self.cv1(x).chunk(2, dim=1)
        return self.cv2(torch.cat((self.m(a), b), dim=1))


class C3(nn.Module):
    """CSP block with three convolutions (YOLOv5): ``cv3(cat(m(cv1(x)), cv2(x)))``.

    Args:
        c1: input channels.
        c2: output channels.
        n: bottlenecks in ``m`` (kernels ``kernels``, expansion 1).
        shortcut: residual bottlenecks.
        groups: groups of each bottleneck's second convolution.
        expansion: hidden channels = ``int(c2 * expansion)``.
        kernels: kernel sizes of each bottleneck's two convolutions ((1, 3) in YOLOv5).
    """

    def __init__(self, c1: int, c2: int, n: int = 1, *, shortcut: bool = True, groups: int = 1,
                 expansion: float = 0.5, kernels: tuple[int, int] = (1, 3), style: ConvStyle = V8_STYLE):
        super().__init__()
        hidden = int(c2 * expansion)
        self.cv1 = Conv(c1, hidden, 1, style=style)
        self.cv2 = Conv(c1, hidden, 1, style=style)
        self.cv3 = Conv(2 * hidden, c2, 1, style=style)
        self.m = nn.Sequential(*(Bottleneck(hidden, hidden, shortcut=shortcut, kernels=kernels, expansion=1.0,
                                            groups=groups, style=style) for _ in range(n)))

    def forward(self, x: Tensor) -> Tensor:
        return self.cv3(torch.cat((self.m(self.cv1(x)), self.cv2(x)), dim=1))


class C3k(C3):
    """``C3`` whose bottlenecks use k x k kernels in both convolutions (the inner block of YOLO11's C3k2)."""

    def __init__(self, c1: int, c2: int, n: int = 1, *, shortcut: bool = True, groups: int = 1,
                 expansion: float = 0.5, k: int = 3, style: ConvStyle = V8_STYLE):
        super().__init__(c1, c2, n, shortcut=shortcut, groups=groups, expansion=expansion, kernels=(k, k),
                         style=style)


class C3k2(C2f):
    """YOLO11's C2f variant: the inner blocks are bottlenecks, ``C3k`` blocks or bottleneck + attention.

    Args:
        c1: input channels.
        c2: output channels.
        n: inner blocks.
        c3k: each inner block is a ``C3k`` of two 3x3 bottlenecks (YOLO11 m/l/x use it everywhere).
        expansion: hidden channels = ``int(c2 * expansion)``.
        attn: each inner block is a bottleneck followed by a ``PSABlock`` (wins over ``c3k``).
        groups: groups of the bottlenecks' second convolutions.
        shortcut: residual bottlenecks.

    Examples:
        >>> C3k2(64, 128, 2, c3k=True)(torch.zeros(1, 64, 8, 8)).shape
        torch.Size([1, 128, 8, 8])
    """

    def __init__(self, c1: int, c2: int, n: int = 1, *, c3k: bool = False, expansion: float = 0.5,
                 attn: bool = False, groups: int = 1, shortcut: bool = True, style: ConvStyle = V8_STYLE):
        def block(c: int) -> nn.Module:
            if attn:
                return nn.Sequential(Bottleneck(c, c, shortcut=shortcut, groups=groups, style=style),
                                     PSABlock(c, attn_ratio=0.5, num_heads=max(c // 64, 1), style=style))
            if c3k:
                return C3k(c, c, 2, shortcut=shortcut, groups=groups, style=style)
            return Bottleneck(c, c, shortcut=shortcut, groups=groups, style=style)   # 3x3, 3x3, expansion 0.5

        super().__init__(c1, c2, n, shortcut=shortcut, expansion=expansion, groups=groups, style=style, block=block)
