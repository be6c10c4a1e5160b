"""The front both detection losses share: check the maps, then compute in float32."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn


class DetectionLoss(nn.Module):
    """Base of ``YOLOv8Loss`` and ``YOLOv3Loss``.

    ``forward(maps, targets)`` checks that there is one map per stride with the channels
    ``map_channels()`` names, then runs the subclass's ``_loss`` on float32 copies outside
    any autocast region (losses stay in float32 under mixed precision), with the targets
    on the maps' device.

    Subclasses set ``strides`` and ``channel_layout`` (how the channels are made up, for
    error messages) and define ``map_channels()`` and ``_loss(maps, targets, max_boxes)``.
    """

    strides: tuple[int, ...]
    channel_layout: str = ""

    def map_channels(self) -> Sequence[int]:
        """Channels each level's map must have, in ``strides`` order."""
        raise NotImplementedError

    def _loss(self, maps: list[Tensor], targets: Tensor, max_boxes: int | None) -> tuple[Tensor, dict[str, Tensor]]:
        raise NotImplementedError

    def forward(self, maps: Sequence[Tensor], targets: Tensor, *,
                max_boxes: int | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """Loss of one batch, without reading anything back from the device.

        Args:
            maps: per level Tensor[B, channels, H_l, W_l], levels in ``strides`` order.
            targets: Tensor[N, 6] rows ``(image_index, class, x1, y1, x2, y2)`` in input pixels,
                image indices in [0, B) (not checked: that would read the device).
            max_boxes: the most boxes one image of the batch holds (G), when the caller knows
                it (the data side does, on the host): the losses then work on targets padded
                per image, which is faster. Fewer than an image holds raises an IndexError
                (CPU) or a device-side assert (CUDA). None: the rows as they come.

        Returns:
            ``(total, parts)``: total a float32 scalar with gradient; parts maps each
            component's name to a detached float32 scalar, gains applied (they sum to total).
        """
        if len(maps) != len(self.strides):
            raise ValueError(f"got {len(maps)} maps for {len(self.strides)} strides")
        for m, want in zip(maps, self.map_channels()):
            if m.ndim != 4 or m.shape[1] != want:
                raise ValueError(f"each map must be Tensor[B, {want}, H, W] ({self.channel_layout}), "
                                 f"got {tuple(m.shape)}")
        if targets.ndim != 2 or targets.shape[1] != 6:
            raise ValueError(f"targets must be Tensor[N, 6] (image_index, class, x1, y1, x2, y2), "
                             f"got {tuple(targets.shape)}")
        with torch.autocast(maps[0].device.type, enabled=False):
            return self._loss([m.float() for m in maps], targets.float().to(maps[0].device), max_boxes)
