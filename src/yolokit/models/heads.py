"""Detection heads: convolutions that produce raw maps, plus ``decode``. No loss inside.

- ``DFLHead`` (YOLOv8, YOLO11): per level a box branch predicting a distribution over
  ``reg_max`` bins for each side and a class branch; Tensor[B, 4 * reg_max + C, H, W] per level.
  With ``reg_max=1`` (YOLO26) each side is one distance, no distribution: Tensor[B, 4 + C, H, W].
- ``EndToEndHead`` (YOLO26): a ``DFLHead`` plus a second branch of the same shape, the one-to-one
  branch, whose one prediction per object needs no NMS. Its raw output is the dict
  ``{"one2many": maps, "one2one": maps}``.
- ``AnchorHead`` (YOLOv3): one 1x1 conv per level; Tensor[B, A * (5 + C), H, W] per level,
  per anchor ``(tx, ty, tw, th, obj, cls...)`` as Darknet lays it out.

``decode`` turns the raw maps into Tensor[B, P, 4 + C]: xyxy boxes in input pixels and class
scores in [0, 1].
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from yolokit.models.layers import V8_STYLE, Conv, DWConv
from yolokit.ops.anchors import anchor_to_box, dfl_expectation, dist_to_box, grid_points
from yolokit.ops.cache import ConstantCache, upload


def _maps(features: list[Tensor], boxes: nn.ModuleList, classes: nn.ModuleList) -> list[Tensor]:
    """Per level the box outputs, then the class logits, along the channels."""
    return [torch.cat((box(x), cls(x)), dim=1)   # not strict: compile traces forward
            for x, box, cls in zip(features, boxes, classes, strict=False)]


class DFL(nn.Module):
    """Fixed projection of a distribution over ``reg_max`` bins onto its expectation.

    Holds a frozen 1x1 conv whose weights are the bin indices 0 .. reg_max - 1 (the layout of
    Ultralytics checkpoints); the expectation is ``ops.anchors.dfl_expectation`` over them.
    """

    def __init__(self, reg_max: int = 16):
        super().__init__()
        self.reg_max = reg_max
        self.conv = nn.Conv2d(reg_max, 1, 1, bias=False).requires_grad_(False)
        with torch.no_grad():
            self.conv.weight.copy_(torch.arange(reg_max, dtype=torch.float32).view(1, reg_max, 1, 1))

    def forward(self, logits: Tensor) -> Tensor:
        """Tensor[B, 4 * reg_max, P] -> expected distances Tensor[B, P, 4] in bin (stride) units."""
        b, _, p = logits.shape
        dist = dfl_expectation(logits.view(b, 4, self.reg_max, p), dim=-2, bins=self.conv.weight.view(-1))
        return dist.transpose(1, 2)  # a view: no permuted copy


class DFLHead(nn.Module):
    """YOLOv8's anchor-free, decoupled head (any number of levels).

    Args:
        in_channels: channels of each input level.
        strides: stride of each level in input pixels.
        num_classes: number of classes C.
        reg_max: bins of each side's distance distribution; 1: one distance per side, no DFL.
        light_cls: YOLO11's class branch: two (3x3 depth-wise conv, 1x1 conv) pairs instead of
            two 3x3 convs. The last layer of each branch is ``cls[i][2]`` either way.
    """

    end_to_end = False   # one branch, decoded with NMS

    def __init__(self, in_channels: Sequence[int], strides: Sequence[int], *, num_classes: int, reg_max: int = 16,
                 light_cls: bool = False):
        super().__init__()
        if isinstance(reg_max, bool) or not isinstance(reg_max, int) or reg_max < 1:
            raise ValueError(f"reg_max must be an integer >= 1, got {reg_max!r}")
        if len(in_channels) != len(strides):
            raise ValueError(f"{len(in_channels)} input levels for {len(strides)} strides")
        self.num_classes, self.reg_max, self.strides = num_classes, reg_max, tuple(int(s) for s in strides)
        self.light_cls = light_cls
        c_box = max(16, in_channels[0] // 4, 4 * reg_max)
        c_cls = max(in_channels[0], min(num_classes, 100))
        self.box = nn.ModuleList(
            nn.Sequential(Conv(c, c_box, 3, style=V8_STYLE), Conv(c_box, c_box, 3, style=V8_STYLE),
                          nn.Conv2d(c_box, 4 * reg_max, 1))
            for c in in_channels
        )
        self.cls = nn.ModuleList(
            nn.Sequential(nn.Sequential(DWConv(c, c, 3), Conv(c, c_cls, 1)),
                          nn.Sequential(DWConv(c_cls, c_cls, 3), Conv(c_cls, c_cls, 1)),
                          nn.Conv2d(c_cls, num_classes, 1))
            if light_cls else
            nn.Sequential(Conv(c, c_cls, 3, style=V8_STYLE), Conv(c_cls, c_cls, 3, style=V8_STYLE),
                          nn.Conv2d(c_cls, num_classes, 1))
            for c in in_channels
        )
        self.dfl = DFL(reg_max) if reg_max > 1 else None   # reg_max 1: the distances are the box outputs
        self._grids = ConstantCache()
        self.reset_bias()

    def branches(self) -> list[tuple[nn.ModuleList, nn.ModuleList]]:
        """(box, class) convolutions of each branch."""
        return [(self.box, self.cls)]

    @torch.no_grad()
    def reset_bias(self) -> None:
        """Class logits log(5 / C / (640 / stride)^2): about 5 objects per 640 image. Box outputs 1.0 (DFL
        logits), or 2.0 with ``reg_max=1`` (each side 2 strides from the point)."""
        for box_convs, cls_convs in self.branches():
            for box, cls, s in zip(box_convs, cls_convs, self.strides, strict=True):
                box[-1].bias.fill_(1.0 if self.reg_max > 1 else 2.0)
                cls[-1].bias.fill_(math.log(5 / self.num_classes / (640 / s) ** 2))

    def forward(self, features: list[Tensor]) -> list[Tensor]:
        return _maps(features, self.box, self.cls)

    def decode(self, maps: list[Tensor]) -> Tensor:
        """Raw maps -> Tensor[B, P, 4 + C]: xyxy pixels and sigmoid class scores."""
        return self._decode(maps)

    def _decode(self, maps: list[Tensor]) -> Tensor:
        shapes = tuple(tuple(m.shape[-2:]) for m in maps)
        flat = torch.cat([m.flatten(2) for m in maps], dim=2)  # [B, 4R + C, P]

        def make() -> tuple[Tensor, Tensor]:
            points, strides = grid_points(shapes, self.strides, dtype=flat.dtype, device=flat.device)
            return points, strides[:, None]

        points, strides = self._grids.get((shapes, flat.dtype, flat.device), make)
        raw = flat[:, : 4 * self.reg_max]
        dist = (self.dfl(raw) if self.dfl is not None else raw.transpose(1, 2)) * strides
        boxes = dist_to_box(dist, points)
        scores = flat[:, 4 * self.reg_max :].sigmoid().transpose(1, 2)
        return torch.cat((boxes, scores), dim=2)


class EndToEndHead(DFLHead):
    """YOLO26's head: the ``DFLHead`` (the one-to-many branch) and a copy of it, the one-to-one branch.

    Both branches read the same maps. The one-to-many branch is trained as YOLOv8's is (ten points per
    object) and decoded with NMS; the one-to-one branch is trained to give each object one point, so
    its decoded output needs only a top-k (``ops.nms.end_to_end_detections``). In training the
    one-to-one branch reads the maps detached: its loss does not reach the backbone and neck.

    ``forward`` returns ``{"one2many": maps, "one2one": maps}`` (each a list of
    Tensor[B, 4 * reg_max + C, H, W], one per level) in train and eval mode alike. The second branch's
    modules are ``one2one_box`` and ``one2one_cls`` (after ``box``, ``cls`` and ``dfl`` in the state
    dict, as the community checkpoints order them).

    Args: those of ``DFLHead`` (YOLO26: ``reg_max=1``, ``light_cls=True``).

    Examples:
        >>> head = EndToEndHead([16, 32], [8, 16], num_classes=3, reg_max=1, light_cls=True)
        >>> out = head([torch.zeros(1, 16, 8, 8), torch.zeros(1, 32, 4, 4)])
        >>> [m.shape[1] for m in out["one2one"]]
        [7, 7]
    """

    end_to_end = True   # a one-to-one branch: detections without NMS
    BRANCHES = ("one2many", "one2one")

    def __init__(self, in_channels: Sequence[int], strides: Sequence[int], *, num_classes: int, reg_max: int = 1,
                 light_cls: bool = True):
        super().__init__(in_channels, strides, num_classes=num_classes, reg_max=reg_max, light_cls=light_cls)
        self.one2one_box = copy.deepcopy(self.box)
        self.one2one_cls = copy.deepcopy(self.cls)

    def branches(self) -> list[tuple[nn.ModuleList, nn.ModuleList]]:
        own = [(self.one2one_box, self.one2one_cls)] if hasattr(self, "one2one_cls") else []
        return [(self.box, self.cls), *own]

    def forward(self, features: list[Tensor]) -> dict[str, list[Tensor]]:   # type: ignore[override]
        inputs = [x.detach() for x in features] if self.training else features
        return {"one2many": _maps(features, self.box, self.cls),
                "one2one": _maps(inputs, self.one2one_box, self.one2one_cls)}

    def decode(self, maps: dict[str, list[Tensor]], branch: str = "one2many") -> Tensor:   # type: ignore[override]
        """The raw output -> Tensor[B, P, 4 + C] of one branch: xyxy pixels and sigmoid class scores.

        Args:
            maps: ``forward``'s dict.
            branch: "one2many" (for NMS, the default) or "one2one" (for ``end_to_end_detections``).
        """
        if branch not in self.BRANCHES:
            raise ValueError(f"branch must be one of {self.BRANCHES}, got {branch!r}")
        if not isinstance(maps, dict) or branch not in maps:
            raise TypeError(f"EndToEndHead.decode takes the head's dict {{'one2many': maps, 'one2one': maps}}, "
                            f"got {type(maps).__name__}")
        return self._decode(maps[branch])


class AnchorHead(nn.Module):
    """YOLOv3's anchor-based head: a 1x1 conv (with bias) per level.

    Args:
        in_channels: channels of each input level.
        strides: stride of each level in input pixels.
        anchors: per level, the (w, h) of its anchors in input pixels.
        num_classes: number of classes C.
    """

    def __init__(self, in_channels: Sequence[int], strides: Sequence[int],
                 anchors: Sequence[Sequence[tuple[int, int]]], *, num_classes: int):
        super().__init__()
        if len(anchors) != len(strides):
            raise ValueError(f"{len(anchors)} anchor groups for {len(strides)} levels")
        self.num_classes, self.strides = num_classes, tuple(strides)
        self.anchors = tuple(tuple((int(w), int(h)) for w, h in level) for level in anchors)
        self.preds = nn.ModuleList(
            nn.Conv2d(c, len(a) * (5 + num_classes), 1) for c, a in zip(in_channels, self.anchors, strict=True)
        )
        self._grids = ConstantCache()
        self.reset_bias()

    @torch.no_grad()
    def reset_bias(self) -> None:
        """Objectness prior of about 8 objects per 640 image, class prior 0.6 / (C - 0.99)."""
        for conv, s, a in zip(self.preds, self.strides, self.anchors, strict=True):
            bias = conv.bias.view(len(a), 5 + self.num_classes)
            bias[:, :4] = 0.0
            bias[:, 4] = math.log(8 / (640 / s) ** 2)
            bias[:, 5:] = math.log(0.6 / max(self.num_classes - 0.99, 0.01))

    def forward(self, features: list[Tensor]) -> list[Tensor]:
        return [conv(x) for x, conv in zip(features, self.preds, strict=False)]   # not strict: compile traces it

    def decode(self, maps: list[Tensor]) -> Tensor:
        """Raw maps -> Tensor[B, P, 4 + C], P = sum of A * H * W (anchor, row, column order).

        Boxes by ``ops.anchors.anchor_to_box`` (Darknet's decoding, t_wh clamped as the loss
        decodes them); class score = sigmoid(obj) * sigmoid(cls).
        """
        out = []
        for m, s, a in zip(maps, self.strides, self.anchors, strict=True):
            b, _, h, w = m.shape
            p = m.view(b, len(a), 5 + self.num_classes, h * w).transpose(2, 3)  # [B, A, HW, 5 + C]
            cells, wh_anchor = self._grids.get((h, w, a, p.dtype, p.device), lambda h=h, w=w, a=a, p=p: (
                grid_points([(h, w)], [1], offset=0.0, dtype=p.dtype, device=p.device)[0],
                upload(a, p.dtype, p.device).view(1, len(a), 1, 2)))
            scores = p[..., 4:5].sigmoid() * p[..., 5:].sigmoid()
            out.append(torch.cat((anchor_to_box(p, cells, s, wh_anchor), scores), dim=-1).flatten(1, 2))
        return torch.cat(out, dim=1)
