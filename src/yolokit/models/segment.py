"""Instance segmentation heads: a detection head whose every prediction also carries ``num_masks`` mask
coefficients, and a prototype network that makes ``num_masks`` maps at twice the finest level's
resolution. A detection's mask is the sigmoid of its coefficients times the prototypes (the coefficient
vector against every prototype pixel), cropped to its box.

- ``SegmentHead`` (YOLOv8-seg, YOLO11-seg): a ``DFLHead``, a coefficient branch per level (two 3x3
  convs and a 1x1 conv to ``num_masks``), and ``Proto`` over the finest level.
- ``EndToEndSegmentHead`` (YOLO26-seg): an ``EndToEndHead`` with a coefficient branch per branch and
  ``FusedProto``, which adds every coarser level into the finest before the prototypes and, in
  training, also predicts a per-class semantic map from the fused features (``semantic``; dropped by
  ``fuse``).

``forward`` returns a dict: the detection head's output under ``"maps"`` (a ``DFLHead``'s list) or
``"one2many"`` / ``"one2one"`` (an ``EndToEndHead``'s), then ``"coefficients"`` (per level
Tensor[B, num_masks, H, W]; ``"one2one_coefficients"`` for the one-to-one branch, read from detached maps
in training as its boxes are), ``"protos"`` (Tensor[B, num_masks, 2 H0, 2 W0]) and, for YOLO26 in
training, ``"semantic"`` (Tensor[B, C, H0, W0]).

The module layout follows the community checkpoints' order (box, class, DFL, one-to-one box and class,
prototypes, coefficients, one-to-one coefficients), under names of our own.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor, nn

from yolokit.models.heads import DFLHead, EndToEndHead
from yolokit.models.layers import Conv


def proto_channels(channels: int, width: float, max_channels: int) -> int:
    """The prototype network's width for a scaled model: ``channels`` capped at ``max_channels`` and
    scaled by ``width``, rounded up to a multiple of 8 (256 at scale n: 64)."""
    return math.ceil(min(channels, max_channels) * width / 8) * 8


class Proto(nn.Module):
    """Prototype masks from the finest level: 3x3 conv, 2x transposed conv, 3x3 conv, 1x1 conv to
    ``c_out`` maps. Tensor[B, c_in, H, W] -> Tensor[B, c_out, 2H, 2W]."""

    def __init__(self, c_in: int, c_mid: int = 256, c_out: int = 32):
        super().__init__()
        self.cv1 = Conv(c_in, c_mid, 3)
        self.upsample = nn.ConvTranspose2d(c_mid, c_mid, 2, 2, 0, bias=True)
        self.cv2 = Conv(c_mid, c_mid, 3)
        self.cv3 = Conv(c_mid, c_out)

    def forward(self, x: Tensor) -> Tensor:
        return self.cv3(self.cv2(self.upsample(self.cv1(x))))


class FusedProto(Proto):
    """YOLO26-seg's prototypes: each coarser level, 1x1-projected to the finest level's channels and
    upsampled (nearest) to its size, is added to it; a 3x3 conv then feeds ``Proto``'s convs. In
    training a semantic branch (two 3x3 convs, a 1x1 conv to one map per class) reads the fused maps.

    Args:
        in_channels: channels of each level, finest first.
        strides: each level's stride (the upsampling factors are their ratios to the finest).
        c_mid, c_out: the prototype network's width and its number of maps.
        num_classes: maps of the semantic branch.
    """

    def __init__(self, in_channels: Sequence[int], strides: Sequence[int], c_mid: int = 256, c_out: int = 32, *,
                 num_classes: int):
        super().__init__(c_mid, c_mid, c_out)
        c0 = in_channels[0]
        self.scales = tuple(int(s) // int(strides[0]) for s in strides[1:])
        self.refine = nn.ModuleList(Conv(c, c0, 1) for c in in_channels[1:])
        self.fuse_conv = Conv(c0, c_mid, 3)
        self.semantic = nn.Sequential(Conv(c0, c_mid, 3), Conv(c_mid, c_mid, 3), nn.Conv2d(c_mid, num_classes, 1))

    def fused(self, features: Sequence[Tensor]) -> Tensor:
        """The finest level with every coarser one added (projected and upsampled)."""
        out = features[0]
        for x, refine, scale in zip(features[1:], self.refine, self.scales, strict=False):
            out = out + F.interpolate(refine(x), scale_factor=scale, mode="nearest")
        return out

    def forward(self, features: Sequence[Tensor]) -> tuple[Tensor, Tensor | None]:   # type: ignore[override]
        """(prototypes, the semantic maps in training, else None)."""
        fused = self.fused(features)
        semantic = self.semantic(fused) if self.training and self.semantic is not None else None
        return super().forward(self.fuse_conv(fused)), semantic

    def drop_semantic(self) -> None:
        """Removes the training-only semantic branch (inference needs the prototypes alone)."""
        self.semantic = None


def _coefficient_branches(in_channels: Sequence[int], num_masks: int) -> nn.ModuleList:
    c = max(in_channels[0] // 4, num_masks)
    return nn.ModuleList(nn.Sequential(Conv(x, c, 3), Conv(c, c, 3), nn.Conv2d(c, num_masks, 1))
                         for x in in_channels)


def _apply(branches: nn.ModuleList, features: Sequence[Tensor]) -> list[Tensor]:
    return [branch(x) for x, branch in zip(features, branches, strict=False)]   # not strict: compile traces it


class SegmentHead(DFLHead):
    """YOLOv8-seg's and YOLO11-seg's head: ``DFLHead``, mask coefficients per prediction and ``Proto``.

    Args: those of ``DFLHead``, and ``num_masks`` (coefficients per prediction, prototype maps) and
    ``proto_channels`` (the prototype network's width; the YAML's 256 scaled by width).

    Examples:
        >>> head = SegmentHead([16, 32], [8, 16], num_classes=3, num_masks=4, proto_channels=8)
        >>> out = head([torch.zeros(1, 16, 8, 8), torch.zeros(1, 32, 4, 4)])
        >>> out["protos"].shape, [c.shape[1] for c in out["coefficients"]]
        (torch.Size([1, 4, 16, 16]), [4, 4])
    """

    segments = True

    def __init__(self, in_channels: Sequence[int], strides: Sequence[int], *, num_classes: int, num_masks: int = 32,
                 proto_channels: int = 256, reg_max: int = 16, light_cls: bool = False):
        super().__init__(in_channels, strides, num_classes=num_classes, reg_max=reg_max, light_cls=light_cls)
        self.num_masks, self.proto_channels = num_masks, proto_channels
        self.proto = Proto(in_channels[0], proto_channels, num_masks)
        self.coef = _coefficient_branches(in_channels, num_masks)

    def forward(self, features: list[Tensor]) -> dict[str, Tensor | list[Tensor]]:   # type: ignore[override]
        return {"maps": super().forward(features), "coefficients": _apply(self.coef, features),
                "protos": self.proto(features[0])}

    def decode(self, maps: dict[str, list[Tensor]]) -> Tensor:   # type: ignore[override]
        """The detection part of ``forward``'s dict -> Tensor[B, P, 4 + C], as ``DFLHead.decode``."""
        return self._decode(maps["maps"])


class EndToEndSegmentHead(EndToEndHead):
    """YOLO26-seg's head: ``EndToEndHead``, mask coefficients for each branch and ``FusedProto``.

    Args: those of ``EndToEndHead``, ``num_masks`` and ``proto_channels`` (as ``SegmentHead``).
    """

    segments = True

    def __init__(self, in_channels: Sequence[int], strides: Sequence[int], *, num_classes: int, num_masks: int = 32,
                 proto_channels: int = 256, reg_max: int = 1, light_cls: bool = True):
        super().__init__(in_channels, strides, num_classes=num_classes, reg_max=reg_max, light_cls=light_cls)
        self.num_masks, self.proto_channels = num_masks, proto_channels
        self.proto = FusedProto(in_channels, strides, proto_channels, num_masks, num_classes=num_classes)
        self.coef = _coefficient_branches(in_channels, num_masks)
        self.one2one_coef = copy.deepcopy(self.coef)

    def forward(self, features: list[Tensor]) -> dict[str, Tensor | list[Tensor]]:   # type: ignore[override]
        out: dict[str, Tensor | list[Tensor]] = dict(super().forward(features))
        inputs = [x.detach() for x in features] if self.training else features
        out["coefficients"] = _apply(self.coef, features)
        out["one2one_coefficients"] = _apply(self.one2one_coef, inputs)
        out["protos"], semantic = self.proto(features)
        if semantic is not None:
            out["semantic"] = semantic
        return out
