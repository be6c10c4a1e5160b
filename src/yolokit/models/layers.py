"""Building blocks shared by backbones, necks and heads.

Every block is made of ``Conv`` (convolution + batch norm + activation). Submodule names
follow the common YOLO naming (``conv``, ``bn``, ``cv1``, ``cv2``, ``m``) so that state
dicts of other implementations map onto these one to one. The CSP blocks of YOLOv5 and
YOLO11 live in ``models.csp``, the attention blocks in ``models.attention``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class ConvStyle:
    """How a family builds its ``Conv``: activation and batch-norm settings.

    Attributes:
        act: "silu" (YOLOv8), "leaky" (Darknet, slope 0.1) or "relu".
        bn_eps: BatchNorm epsilon.
        bn_momentum: BatchNorm momentum (PyTorch convention: weight of the new batch).
    """

    act: str = "silu"
    bn_eps: float = 1e-3
    bn_momentum: float = 0.03


V8_STYLE = ConvStyle("silu", 1e-3, 0.03)
DARKNET_STYLE = ConvStyle("leaky", 1e-5, 0.01)  # Darknet: eps 1e-5 (cuDNN), rolling average 0.99


def _activation(name: str) -> nn.Module:
    """The block's activation. SiLU is out of place: autograd saves a copy of an in-place
    SiLU's input for its backward (one extra copy kernel per convolution). LeakyReLU's
    backward reads its output, so in place it saves an allocation and copies nothing."""
    if name == "silu":
        return nn.SiLU()
    if name == "leaky":
        return nn.LeakyReLU(0.1, inplace=True)
    if name == "relu":
        return nn.ReLU(inplace=True)  # its backward reads the output, as LeakyReLU's does
    raise ValueError(f"unknown activation {name!r}; expected 'silu', 'leaky' or 'relu'")


class Conv(nn.Module):
    """Convolution (no bias) + BatchNorm + activation, 'same' padding for odd kernels.

    ``fuse()`` folds the batch norm into the convolution for inference: afterwards
    ``conv`` has a bias, ``bn`` is an Identity, and outputs are unchanged.

    Args:
        c1: input channels.
        c2: output channels.
        k: kernel size.
        s: stride.
        p: padding; None pads ``(d * (k - 1) + 1) // 2`` (keeps the size at stride 1).
        style: activation and batch-norm settings.
        g: groups.
        d: dilation.
        act: False for no activation (an Identity).
    """

    def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1, p: int | None = None, *,
                 style: ConvStyle = V8_STYLE, g: int = 1, d: int = 1, act: bool = True):
        super().__init__()
        p = (d * (k - 1) + 1) // 2 if p is None else p
        self.conv = nn.Conv2d(c1, c2, k, s, p, dilation=d, groups=g, bias=False)
        self.bn: nn.Module = nn.BatchNorm2d(c2, eps=style.bn_eps, momentum=style.bn_momentum)
        self.act = _activation(style.act) if act else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        if self.fused:  # no Identity call: a module call costs more than it does
            return self.act(self.conv(x))
        return self.act(self.bn(self.conv(x)))

    @property
    def fused(self) -> bool:
        return isinstance(self.bn, nn.Identity)

    @torch.no_grad()
    def fuse(self) -> None:
        """Folds ``bn`` into ``conv`` in place (idempotent)."""
        if self.fused:
            return
        conv, bn = self.conv, self.bn
        scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
        fused = nn.Conv2d(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                          conv.dilation, conv.groups, bias=True).to(conv.weight.device, conv.weight.dtype)
        fused.weight.copy_(conv.weight * scale.view(-1, 1, 1, 1))
        bias = conv.bias if conv.bias is not None else torch.zeros_like(bn.running_mean)
        fused.bias.copy_(bn.bias + (bias - bn.running_mean) * scale)
        self.conv, self.bn = fused, nn.Identity()


class DWConv(Conv):
    """Depth-wise ``Conv``: groups = gcd(c1, c2) (one group per channel when c1 == c2)."""

    def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1, *, d: int = 1, act: bool = True,
                 style: ConvStyle = V8_STYLE):
        super().__init__(c1, c2, k, s, style=style, g=math.gcd(c1, c2), d=d, act=act)


class Concat(nn.Module):
    """Concatenates a list of tensors along ``dim`` (channels by default)."""

    def __init__(self, dim: int = 1):
        super().__init__()
        self.dim = dim

    def forward(self, xs: list[Tensor]) -> Tensor:
        return torch.cat(xs, self.dim)


class Index(nn.Module):
    """Picks one tensor of a list (a layer that returns several maps, such as a timm backbone)."""

    def __init__(self, index: int = 0):
        super().__init__()
        self.index = index

    def forward(self, xs: list[Tensor]) -> Tensor:
        return xs[self.index]


class Bottleneck(nn.Module):
    """Two convolutions with an optional residual: ``x + cv2(cv1(x))``.

    Args:
        c1: input channels.
        c2: output channels.
        shortcut: add the input (only when ``c1 == c2``).
        kernels: kernel sizes of ``cv1`` and ``cv2``.
        expansion: hidden channels = ``int(c2 * expansion)``.
        groups: groups of ``cv2``.
    """

    def __init__(self, c1: int, c2: int, *, shortcut: bool = True, kernels: tuple[int, int] = (3, 3),
                 expansion: float = 0.5, groups: int = 1, style: ConvStyle = V8_STYLE):
        super().__init__()
        hidden = int(c2 * expansion)
        self.cv1 = Conv(c1, hidden, kernels[0], style=style)
        self.cv2 = Conv(hidden, c2, kernels[1], style=style, g=groups)
        self.add = shortcut and c1 == c2

    def forward(self, x: Tensor) -> Tensor:
        y = self.cv2(self.cv1(x))
        return x + y if self.add else y


class C2f(nn.Module):
    """CSP block with two convolutions and ``n`` bottlenecks whose outputs all feed ``cv2``.

    ``cv1`` makes 2 * hidden channels (hidden = ``int(c2 * expansion)``), split in two
    halves; each inner block takes the last piece and appends its output; ``cv2`` fuses the
    (2 + n) pieces. The inner blocks are ``block(hidden)`` (default: a ``Bottleneck`` of
    expansion 1 whose second convolution has ``groups``).
    """

    def __init__(self, c1: int, c2: int, n: int = 1, *, shortcut: bool = False, expansion: float = 0.5,
                 groups: int = 1, style: ConvStyle = V8_STYLE, block: Callable[[int], nn.Module] | None = None):
        super().__init__()
        self.hidden = int(c2 * expansion)
        self.cv1 = Conv(c1, 2 * self.hidden, 1, style=style)
        self.cv2 = Conv((2 + n) * self.hidden, c2, 1, style=style)
        if block is None:
            def block(c: int) -> nn.Module:
                return Bottleneck(c, c, shortcut=shortcut, expansion=1.0, groups=groups, style=style)
        self.m = nn.ModuleList(block(self.hidden) for _ in range(n))

    def forward(self, x: Tensor) -> Tensor:
        pieces = list(self.cv1(x).chunk(2, dim=1))
        for block in self.m:
            pieces.append(block(pieces[-1]))
        return self.cv2(torch.cat(pieces, dim=1))


class SPPF(nn.Module):
    """Spatial pyramid pooling, fast: ``n`` (3) chained k x k max-pools (YOLOv8).

    ``cv2(cat(x', p(x'), p(p(x')), p(p(p(x')))))`` with ``x' = cv1(x)``, equal to pooling
    at k, 2k - 1 and 3k - 2 in parallel. ``shortcut`` adds the input (when c1 == c2);
    ``cv1_act=False`` leaves ``cv1`` without activation (the form of newer model files).
    """

    def __init__(self, c1: int, c2: int, k: int = 5, *, n: int = 3, shortcut: bool = False, cv1_act: bool = True,
                 style: ConvStyle = V8_STYLE):
        super().__init__()
        hidden = c1 // 2
        self.cv1 = Conv(c1, hidden, 1, style=style, act=cv1_act)
        self.cv2 = Conv(hidden * (n + 1), c2, 1, style=style)
        self.m = nn.MaxPool2d(k, 1, k // 2)
        self.n, self.add = n, shortcut and c1 == c2

    def forward(self, x: Tensor) -> Tensor:
        pieces = [self.cv1(x)]
        for _ in range(self.n):
            pieces.append(self.m(pieces[-1]))
        y = self.cv2(torch.cat(pieces, dim=1))
        return x + y if self.add else y


class SPP(nn.Module):
    """Spatial pyramid pooling (YOLOv3-SPP as model YAMLs describe it): ``cv1``, parallel pools, ``cv2``.

    ``cv2(cat(x', pool_k1(x'), pool_k2(x'), ...))`` with ``x' = cv1(x)`` (c1 // 2 channels), the
    input first and the pools in the order of ``kernels``.
    """

    def __init__(self, c1: int, c2: int, kernels: tuple[int, ...] = (5, 9, 13), *, style: ConvStyle = V8_STYLE):
        super().__init__()
        hidden = c1 // 2
        self.cv1 = Conv(c1, hidden, 1, style=style)
        self.cv2 = Conv(hidden * (len(kernels) + 1), c2, 1, style=style)
        self.m = nn.ModuleList(nn.MaxPool2d(k, 1, k // 2) for k in kernels)

    def forward(self, x: Tensor) -> Tensor:
        x = self.cv1(x)
        return self.cv2(torch.cat([x, *(pool(x) for pool in self.m)], dim=1))


class DarknetSPP(nn.Module):
    """Darknet's spatial pyramid pooling: parallel stride-1 max-pools, concatenated.

    Channels are concatenated in Darknet's route order: the largest pool first and the
    input last (``route -1,-3,-5,-6`` of yolov3-spp.cfg). No parameters.
    """

    def __init__(self, kernels: tuple[int, ...] = (5, 9, 13)):
        super().__init__()
        self.kernels = tuple(kernels)

    def forward(self, x: Tensor) -> Tensor:
        pools = [F.max_pool2d(x, k, 1, k // 2) for k in reversed(self.kernels)]
        return torch.cat([*pools, x], dim=1)


class DarknetResidual(nn.Module):
    """Darknet-53 residual unit: ``x + cv2(cv1(x))`` with a 1x1 halving and a 3x3 restoring."""

    def __init__(self, c: int, *, style: ConvStyle = DARKNET_STYLE):
        super().__init__()
        self.cv1 = Conv(c, c // 2, 1, style=style)
        self.cv2 = Conv(c // 2, c, 3, style=style)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.cv2(self.cv1(x))


class MaxPoolSame(nn.Module):
    """Darknet's max-pool of size k, stride 1: output keeps the input size.

    The window at (i, j) covers rows i .. i + k - 1 (columns likewise) and takes the max
    over the part of it inside the image, as Darknet does; nothing is zero-padded.
    """

    def __init__(self, k: int = 2):
        super().__init__()
        self.k = k

    def forward(self, x: Tensor) -> Tensor:
        x = F.pad(x, (0, self.k - 1, 0, self.k - 1), value=float("-inf"))
        return F.max_pool2d(x, self.k, 1)
