"""YOLOv3's anchor matching (Darknet's): each ground-truth box trains one anchor, at one cell."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from yolokit.ops.cache import ConstantCache, upload


class AnchorMatch(NamedTuple):
    """Where each GT box trains, flat over the batch (one row per real GT).

    Attributes:
        image: Tensor[N] int64 image index.
        level: Tensor[N] int64 pyramid level of the chosen anchor.
        anchor: Tensor[N] int64 anchor index within its level.
        cell_x: Tensor[N] int64 column of the cell holding the box centre at that level.
        cell_y: Tensor[N] int64 row of that cell.
        flat_anchor: Tensor[N] int64 index into the flattened list of all anchors.
    """

    image: Tensor
    level: Tensor
    anchor: Tensor
    cell_x: Tensor
    cell_y: Tensor
    flat_anchor: Tensor


def wh_iou(wh1: Tensor, wh2: Tensor) -> Tensor:
    """IoU of boxes sharing one centre, from their sizes.

    Args:
        wh1: Tensor[N, 2] (w, h).
        wh2: Tensor[M, 2] (w, h).

    Returns:
        Tensor[N, M].
    """
    wh1, wh2 = wh1.float()[:, None], wh2.float()[None]
    inter = torch.minimum(wh1, wh2).clamp(min=0).prod(-1)
    return inter / (wh1.clamp(min=0).prod(-1) + wh2.prod(-1) - inter + 1e-9)


class AnchorMatcher(nn.Module):
    """YOLOv3's (Darknet's) matcher: each GT goes to the one anchor, over all levels,
    whose size best overlaps its own (IoU of centred boxes), at the cell holding its centre.

    Anchors are taken as the flattened list of every level's anchors; when one size
    appears at two levels (yolov3-tiny repeats (81, 82)) the first occurrence, the finer
    level, wins. Centres outside the image are clamped to the border cells.

    Args:
        anchors: per level, the (w, h) of its anchors in input pixels.
        strides: stride of each level in input pixels.
    """

    def __init__(self, anchors: Sequence[Sequence[tuple[float, float]]], strides: Sequence[int]):
        super().__init__()
        if len(anchors) != len(strides):
            raise ValueError(f"{len(anchors)} anchor groups for {len(strides)} levels")
        self.strides = tuple(int(s) for s in strides)
        self.num_anchors = tuple(len(a) for a in anchors)
        self.anchors = tuple(tuple((float(w), float(h)) for w, h in level) for level in anchors)
        self._constants = ConstantCache()

    def _tables(self, shapes: tuple[tuple[int, int], ...], device: torch.device) -> tuple[Tensor, ...]:
        """Anchor sizes, levels and indices, level strides and map sizes on ``device`` (built once per shapes)."""
        flat = [(lvl, j, wh) for lvl, level in enumerate(self.anchors) for j, wh in enumerate(level)]
        return (upload([wh for _, _, wh in flat], device=device),                          # [sum A, 2]
                upload([lvl for lvl, _, _ in flat], device=device),
                upload([j for _, j, _ in flat], device=device),
                upload(self.strides, torch.float32, device),
                upload(shapes, torch.float32, device))                                      # [L, 2] (h, w)

    def extra_repr(self) -> str:
        return f"anchors={self.anchors}, strides={self.strides}"

    @torch.no_grad()
    def forward(self, targets: Tensor, shapes: Sequence[tuple[int, int]]) -> AnchorMatch:
        """Matches every target row to an anchor and a cell.

        Args:
            targets: Tensor[N, 6] rows ``(image_index, class, x1, y1, x2, y2)`` in pixels.
            shapes: (height, width) of each level's map.

        Returns:
            ``AnchorMatch`` with one row per target row, in the same order.
        """
        shapes = tuple(tuple(int(v) for v in s) for s in shapes)
        anchor_wh, anchor_level, anchor_index, strides, sizes = self._constants.get(
            (shapes, targets.device), lambda: self._tables(shapes, targets.device))   # no host copy per call

        boxes = targets[:, 2:6].float()
        centre = (boxes[:, :2] + boxes[:, 2:]) / 2
        best = wh_iou(boxes[:, 2:] - boxes[:, :2], anchor_wh).argmax(dim=1)  # first maximum wins
        level = anchor_level[best]
        stride = strides[level]
        size = sizes[level]  # (h, w)
        cell = (centre / stride[:, None]).floor()
        cell_x = torch.minimum(cell[:, 0].clamp(min=0), size[:, 1] - 1).long()
        cell_y = torch.minimum(cell[:, 1].clamp(min=0), size[:, 0] - 1).long()
        return AnchorMatch(targets[:, 0].long(), level, anchor_index[best], cell_x, cell_y, best)
