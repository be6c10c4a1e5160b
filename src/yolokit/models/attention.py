"""Attention blocks of YOLO11 model files: ``Attention``, ``PSABlock`` and ``C2PSA``.

Submodule names follow the community model files (``qkv``, ``proj``, ``pe``, ``attn``,
``ffn``, ``cv1``, ``cv2``, ``m``), so their state dicts map onto these one to one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from yolokit.models.layers import V8_STYLE, Conv, ConvStyle


class Attention(nn.Module):
    """Multi-head self-attention over the pixels of a map, plus a depth-wise positional term.

    ``qkv`` (1x1) gives per head a query and key of ``key_dim`` channels and a value of
    ``head_dim = dim // num_heads`` channels; the output is
    ``proj(attention(q, k, v) + pe(v))`` where ``pe`` is a 3x3 depth-wise convolution of
    the values laid out as a map. Scores are scaled by ``key_dim ** -0.5``.

    Args:
        dim: input and output channels.
        num_heads: attention heads (``dim`` must be a multiple).
        attn_ratio: ``key_dim = int(head_dim * attn_ratio)``.
    """

    def __init__(self, dim: int, num_heads: int = 8, attn_ratio: float = 0.5, *, style: ConvStyle = V8_STYLE):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"Attention: dim {dim} is not a multiple of num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.key_dim = int(self.head_dim * attn_ratio)
        self.qkv = Conv(dim, dim + 2 * self.key_dim * num_heads, 1, style=style, act=False)
        self.proj = Conv(dim, dim, 1, style=style, act=False)
        self.pe = Conv(dim, dim, 3, style=style, g=dim, act=False)

    def forward(self, x: Tensor) -> Tensor:
        """Tensor[B, C, H, W] -> Tensor[B, C, H, W]."""
        b, c, h, w = x.shape
        qkv = self.qkv(x).view(b, self.num_heads, 2 * self.key_dim + self.head_dim, h * w)
        q, k, v = qkv.split((self.key_dim, self.key_dim, self.head_dim), dim=2)
        # [B, heads, HW, d]: one query per pixel; SDPA scales by key_dim ** -0.5
        out = F.scaled_dot_product_attention(q.transpose(-2, -1), k.transpose(-2, -1), v.transpose(-2, -1))
        out = out.transpose(-2, -1).reshape(b, c, h, w) + self.pe(v.reshape(b, c, h, w))
        return self.proj(out)


class PSABlock(nn.Module):
    """Attention then a 1x1 feed-forward pair (2x expansion), each with a residual when ``shortcut``."""

    def __init__(self, c: int, attn_ratio: float = 0.5, num_heads: int = 4, shortcut: bool = True, *,
                 style: ConvStyle = V8_STYLE):
        super().__init__()
        self.attn = Attention(c, num_heads, attn_ratio, style=style)
        self.ffn = nn.Sequential(Conv(c, 2 * c, 1, style=style), Conv(2 * c, c, 1, style=style, act=False))
        self.add = shortcut

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(x) if self.add else self.attn(x)
        return x + self.ffn(x) if self.add else self.ffn(x)


class C2PSA(nn.Module):
    """CSP block of ``n`` PSABlocks (YOLO11, after SPPF): ``cv2(cat(a, m(b)))`` with ``a, b`` halves of ``cv1(x)``.

    Args:
        c1: input channels.
        c2: output channels (must equal ``c1``).
        n: PSABlocks; each has ``max(hidden // 64, 1)`` heads.
        expansion: hidden channels per half = ``int(c1 * expansion)``.

    Examples:
        >>> C2PSA(128, 128, 1)(torch.zeros(1, 128, 4, 4)).shape
        torch.Size([1, 128, 4, 4])
    """

    def __init__(self, c1: int, c2: int, n: int = 1, *, expansion: float = 0.5, style: ConvStyle = V8_STYLE):
        super().__init__()
        if c1 != c2:
            raise ValueError(f"C2PSA keeps its channels: input {c1} != output {c2}")
        self.hidden = int(c1 * expansion)
        self.cv1 = Conv(c1, 2 * self.hidden, 1, style=style)
        self.cv2 = Conv(2 * self.hidden, c1, 1, style=style)
        self.m = nn.Sequential(*(PSABlock(self.hidden, attn_ratio=0.5, num_heads=max(self.hidden // 64, 1),
                                          style=style) for _ in range(n)))

    def forward(self, x: Tensor) -> Tensor:
        a, b = self.cv1(x).split((self.hidden, self.hidden), dim=1)
        return self.cv2(torch.cat((a, self.m(b)), dim=1))
