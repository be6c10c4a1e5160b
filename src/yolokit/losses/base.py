"""The front both detection losses share: check the maps, compute in float32, pad targets per image."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn


class DetectionLoss(nn.Module):
    """Base of ``YOLOv8Loss`` and ``YOLOv3Loss``.

    ``forward(maps, targets)`` checks that there is one map per stride with the channels
    ``map_channels()`` names, then runs the subclass's ``_loss`` on float32 copies outside
    any autocast region (losses stay in float32 under mixed precision). The targets must
    already be on the maps' device: a batch gets there once, by ``yolokit.data.to_device``
    (or the caller's own ``.to(device)``); a loss moves nothing.

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

    takes_padded_targets: bool = False   # forward also takes PaddedTargets (a static shape: CUDA graphs)

    def forward(self, maps: Sequence[Tensor], targets: Tensor | PaddedTargets, *,
                max_boxes: int | None = None, **extra) -> tuple[Tensor, dict[str, Tensor]]:
        """Loss of one batch, without reading anything back from the device.

        Args:
            maps: per level Tensor[B, channels, H_l, W_l], levels in ``strides`` order.
            targets: Tensor[N, 6] rows ``(image_index, class, x1, y1, x2, y2)`` in input pixels,
                on the maps' device, image indices in [0, B) (not checked: that would read the
                device). Losses with ``takes_padded_targets`` also take :class:`PaddedTargets`
                (``pad_targets``' result, its G any number of slots at least the busiest image's):
                shapes that do not follow the number of boxes, as a CUDA graph needs.
            max_boxes: the most boxes one image of the batch holds (G), when the caller knows
                it (the data side does, on the host): the losses then work on targets padded
                per image, which is faster. Fewer than an image holds raises an IndexError
                (CPU) or a device-side assert (CUDA). None: the rows as they come.
            extra: passed on to ``_loss`` (a subclass's further inputs, such as masks).

        Returns:
            ``(total, parts)``: total a float32 scalar with gradient; parts maps each
            component's name to a detached float32 scalar, gains applied (they sum to total).

        Raises:
            ValueError: maps or targets of the wrong shape, or targets on another device.
        """
        if len(maps) != len(self.strides):
            raise ValueError(f"got {len(maps)} maps for {len(self.strides)} strides")
        for m, want in zip(maps, self.map_channels(), strict=True):
            if m.ndim != 4 or m.shape[1] != want:
                raise ValueError(f"each map must be Tensor[B, {want}, H, W] ({self.channel_layout}), "
                                 f"got {tuple(m.shape)}")
        padded = isinstance(targets, PaddedTargets)
        if padded:
            self._check_padded(targets, maps[0].shape[0])
        elif targets.ndim != 2 or targets.shape[1] != 6:
            raise ValueError(f"targets must be Tensor[N, 6] (image_index, class, x1, y1, x2, y2), "
                             f"got {tuple(targets.shape)}")
        device = targets.boxes.device if padded else targets.device
        if device != maps[0].device:
            raise ValueError(f"targets are on {device} but the maps on {maps[0].device}: move the "
                             "batch once, with yolokit.data.to_device (a loss moves nothing)")
        if padded:   # G slots per image, whatever the busiest image holds
            targets, max_boxes = targets._replace(boxes=targets.boxes.float()), targets.labels.shape[1]
        else:
            targets = targets.float()
        with torch.autocast(maps[0].device.type, enabled=False):
            return self._loss([m.float() for m in maps], targets, max_boxes, **extra)

    def _check_padded(self, targets: PaddedTargets, b: int) -> None:
        if not self.takes_padded_targets:
            raise TypeError(f"{type(self).__name__} takes targets as Tensor[N, 6] rows, not PaddedTargets")
        labels, boxes, mask = targets
        if labels.shape[0] != b or labels.ndim != 2 or mask.shape != labels.shape or \
                boxes.shape != (*labels.shape, 4):
            raise ValueError(f"PaddedTargets for {b} images must be labels [B, G], boxes [B, G, 4], mask [B, G]; "
                             f"got {tuple(labels.shape)}, {tuple(boxes.shape)}, {tuple(mask.shape)}")


class PaddedTargets(NamedTuple):
    """Ground truth of a batch padded to the busiest image.

    Attributes:
        labels: Tensor[B, G] int64 class indices (0 where padding).
        boxes: Tensor[B, G, 4] float32 xyxy in input pixels (0 where padding).
        mask: Tensor[B, G] bool, True for real boxes.
    """

    labels: Tensor
    boxes: Tensor
    mask: Tensor

    def rows(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The padded boxes as flat rows, image-major (row = image * G + slot), as
        ``TaskAlignedAssigner.assign_rows(..., per_image=G)`` takes them.

        Returns:
            ``(image, labels, boxes, valid)``: Tensor[B * G] int64, Tensor[B * G] int64,
            Tensor[B * G, 4], Tensor[B * G] bool (False at padding).
        """
        b, g = self.labels.shape
        image = torch.arange(b, device=self.labels.device)[:, None].expand(b, g).reshape(-1)
        return image, self.labels.reshape(-1), self.boxes.reshape(-1, 4), self.mask.reshape(-1)


def pad_targets(targets: Tensor, batch_size: int, *, max_boxes: int | None = None) -> PaddedTargets:
    """Splits flat batch targets into per-image padded tensors, without a loop.

    Args:
        targets: Tensor[N, 6] rows ``(image_index, class, x1, y1, x2, y2)`` in input pixels.
        batch_size: number of images B; every image index must lie in [0, B).
        max_boxes: G, when the caller knows it (e.g. from the data side): then nothing is
            read back from the device. An image with more boxes, or an image index outside
            [0, B), then raises an IndexError (on the CPU) or a device-side assert (CUDA).
            None: G is the largest number of boxes in one image, read from the device
            (one read, which also checks the image indices).

    Returns:
        ``PaddedTargets`` with G = ``max_boxes``, or the largest number of boxes in one image
        (0 when N = 0). Within an image, boxes keep the order they have in ``targets``.

    Examples:
        >>> t = torch.tensor([[1, 2, 0, 0, 4, 4], [1, 0, 1, 1, 2, 2.0]])
        >>> p = pad_targets(t, 3)
        >>> p.boxes.shape, p.mask.tolist()
        (torch.Size([3, 2, 4]), [[False, False], [True, True], [False, False]])
    """
    if targets.ndim != 2 or targets.shape[1] != 6:
        raise ValueError(f"targets must be Tensor[N, 6], got shape {tuple(targets.shape)}")
    device = targets.device
    image = targets[:, 0].long()
    if max_boxes is None and targets.shape[0]:
        ones = torch.ones_like(image)
        counts = torch.zeros(batch_size, dtype=torch.long, device=device)
        counts.index_add_(0, image.clamp(0, batch_size - 1), ones)
        g, low, high = torch.stack((counts.max(), image.min(), image.max())).tolist()
        if low < 0 or high >= batch_size:
            raise ValueError(f"targets name image index {high if high >= batch_size else low} "
                             f"but the batch holds {batch_size} images")
    else:
        g = max_boxes or 0
        counts = torch.zeros(batch_size, dtype=torch.long, device=device).index_add_(0, image, torch.ones_like(image))
    labels = torch.zeros(batch_size, g, dtype=torch.long, device=device)
    boxes = torch.zeros(batch_size, g, 4, dtype=torch.float32, device=device)
    # an image's boxes fill its slots from 0: slot s is real where s < the image's count. (Writing a
    # Python True through the indices instead copies a host scalar to the device and waits for it.)
    mask = torch.arange(g, device=device) < counts[:, None]
    if targets.shape[0]:
        image_sorted, order = torch.sort(image, stable=True)
        starts = counts.cumsum(0) - counts
        slot = torch.arange(image.numel(), device=device) - starts[image_sorted]
        rows = targets[order].float()
        labels[image_sorted, slot] = rows[:, 1].long()
        boxes[image_sorted, slot] = rows[:, 2:6]
    return PaddedTargets(labels, boxes, mask)


def as_padded(targets: Tensor | PaddedTargets, batch_size: int, max_boxes: int) -> PaddedTargets:
    """``targets`` padded per image to ``max_boxes`` slots (``pad_targets``), or as they are when already padded."""
    if isinstance(targets, PaddedTargets):
        return targets
    return pad_targets(targets, batch_size, max_boxes=max_boxes)
