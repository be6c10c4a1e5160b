"""YOLOv8-seg's loss: YOLOv8's three detection terms, the mask term, and (a head with a semantic branch) the
semantic term."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from yolokit.losses.base import PaddedTargets
from yolokit.losses.masks import mask_loss, semantic_loss, semantic_targets
from yolokit.losses.yolov8 import YOLOv8Loss
from yolokit.ops.masks import point_coefficients


class YOLOv8SegLoss(YOLOv8Loss):
    """Loss of a ``SegmentHead`` (YOLOv8-seg, YOLO11-seg) on its training output.

    The detection terms are :class:`YOLOv8Loss`'s, on the same assignment. Each positive point then trains
    its mask (:func:`yolokit.losses.masks.mask_loss`: its coefficients times its image's prototypes, BCE
    against its object's mask inside the object's box, per box area, mean over positive points). With
    semantic maps in the output (a ``FusedProto``'s training branch), the semantic term
    (:func:`yolokit.losses.masks.semantic_loss`) is added while the batch has a positive point. Both take
    the ``seg`` gain, the box gain by default (as the reference's ``box`` gain scales them).

    ``total = box + seg + cls + dfl (+ sem)``, each with its gain, normalized per batch (not multiplied
    by the batch size: see :class:`YOLOv8Loss`).

    Args:
        num_classes, strides, reg_max, box, cls, dfl, topk, alpha, beta: as :class:`YOLOv8Loss`.
        num_masks: coefficients per point (prototype maps).
        overlap: the masks come as one index map per image (True, the default) or one mask per object.
        seg: gain of the mask and semantic terms; None: ``box``.

    Examples:
        >>> loss_fn = YOLOv8SegLoss(num_classes=3, strides=(8, 16, 32), num_masks=4)
        >>> out = {"maps": [torch.randn(2, 67, s, s) for s in (8, 4, 2)],
        ...        "coefficients": [torch.randn(2, 4, s, s) for s in (8, 4, 2)], "protos": torch.randn(2, 4, 16, 16)}
        >>> masks = torch.zeros(2, 16, 16); masks[0, 2:10, 2:8] = 1
        >>> total, parts = loss_fn(out, torch.tensor([[0, 1, 8.0, 8.0, 32.0, 40.0]]), masks=masks)
        >>> sorted(parts)
        ['box', 'cls', 'dfl', 'seg']
    """

    def __init__(self, num_classes: int, strides: Sequence[int], *, num_masks: int = 32, overlap: bool = True,
                 seg: float | None = None, **kwargs):
        super().__init__(num_classes, strides, **kwargs)
        self.num_masks, self.overlap = num_masks, overlap
        self.gains["seg"] = self.gains["box"] if seg is None else seg

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_masks={self.num_masks}, overlap={self.overlap}"

    def forward(self, outputs: Mapping[str, Tensor | Sequence[Tensor]], targets: Tensor | PaddedTargets, *,
                masks: Tensor, max_boxes: int | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """Loss of one batch.

        Args:
            outputs: the head's training output: ``"maps"`` (per level Tensor[B, 4 * reg_max + C, H_l, W_l]),
                ``"coefficients"`` (per level Tensor[B, num_masks, H_l, W_l]), ``"protos"`` (Tensor[B,
                num_masks, h, w]) and optionally ``"semantic"`` (Tensor[B, C, h', w']).
            targets, max_boxes: as :meth:`DetectionLoss.forward`.
            masks: ``overlap``: Tensor[B, H', W'], ``k + 1`` where the image's k-th box (in the targets'
                order) lies, 0 elsewhere; else one 0/1 mask per box, Tensor[N, H', W'] in the targets' order
                (Tensor[B, G, H', W'] with ``PaddedTargets``). At another size than the prototypes', the
                prototypes are resized to it (bilinear).

        Returns:
            ``(total, parts)`` with parts ``box``, ``seg``, ``cls``, ``dfl`` (and ``sem``), gains applied.
        """
        if not isinstance(outputs, Mapping) or not {"maps", "coefficients", "protos"} <= set(outputs):
            raise ValueError("a segmentation loss takes the seg head's output: a dict with 'maps', 'coefficients' "
                             f"and 'protos', got {type(outputs).__name__}")
        coefficients, protos = outputs["coefficients"], outputs["protos"]
        if protos.ndim != 4 or protos.shape[1] != self.num_masks or \
                any(c.ndim != 4 or c.shape[1] != self.num_masks for c in coefficients):
            raise ValueError(f"coefficients and prototypes must have num_masks={self.num_masks} channels: got "
                             f"{[tuple(c.shape) for c in coefficients]} and {tuple(protos.shape)}")
        b = protos.shape[0]
        if self.overlap and (masks.ndim != 3 or masks.shape[0] != b):
            raise ValueError(f"overlap masks must be one index map per image, Tensor[{b}, H, W]; "
                             f"got {tuple(masks.shape)}")
        if not self.overlap and masks.ndim != (4 if isinstance(targets, PaddedTargets) else 3):
            raise ValueError(f"per-object masks must be Tensor[N, H, W] (Tensor[B, G, H, W] with PaddedTargets); "
                             f"got {tuple(masks.shape)}")
        return super().forward(outputs["maps"], targets, max_boxes=max_boxes, outputs=outputs, masks=masks)

    def _loss(self, maps: list[Tensor], targets: Tensor | PaddedTargets, max_boxes: int | None, *,
              outputs: Mapping[str, Tensor | Sequence[Tensor]], masks: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        parts, assigned, gt = self._terms(maps, targets, max_boxes)
        return with_mask_terms(self, parts, assigned.point_row, gt, maps, targets, max_boxes,
                               flat_coefficients(outputs["coefficients"]), outputs["protos"], outputs.get("semantic"),
                               masks)


def flat_coefficients(levels: Sequence[Tensor]) -> Tensor:
    """Per level Tensor[B, M, H_l, W_l] as one Tensor[B, M, P], the levels in order (float32):
    ``ops.masks.point_coefficients`` with the points last."""
    return point_coefficients(levels).transpose(1, 2).float()


def with_mask_terms(loss, parts: dict[str, Tensor], point_row: Tensor, gt: tuple, maps: list[Tensor],
                    targets: Tensor | PaddedTargets, max_boxes: int | None, coefficients: Tensor, protos: Tensor,
                    semantic: Tensor | None, masks: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """A detection loss's parts with the mask term (and the semantic term) added: ``(total, detached parts)``
    in the reference's order (box, seg, cls, the distance term, sem).

    ``loss`` gives ``overlap``, ``strides``, ``num_classes`` and ``gains["seg"]``; ``point_row`` and ``gt``
    are its assignment's (rows as given, or padded slots)."""
    b = maps[0].shape[0]
    image, labels, boxes, _ = gt
    if max_boxes is not None and not isinstance(targets, PaddedTargets):   # padded slots -> the targets' rows
        point_row, image, labels, boxes = _rows_as_given(point_row, targets, b, max_boxes)
    elif isinstance(targets, PaddedTargets) and not loss.overlap:
        masks = masks.flatten(0, 1)                                        # [B * G, H', W'], slot order
    height, width = maps[0].shape[-2] * loss.strides[0], maps[0].shape[-1] * loss.strides[0]
    seg = mask_loss(coefficients, protos.float(), point_row, image, boxes, masks, (height, width),
                    overlap=loss.overlap)
    parts["seg"] = seg * loss.gains["seg"]
    if semantic is not None:
        target = semantic_targets(masks, image, labels, b, loss.num_classes, overlap=loss.overlap)
        any_positive = (point_row < len(image)).any()       # the reference's term only with a positive point
        parts["sem"] = semantic_loss(semantic, target) * any_positive * loss.gains["seg"]
    order = ("box", "seg", "cls", "dfl", "l1", "sem")
    parts = {k: parts[k] for k in sorted(parts, key=order.index)}
    return sum(parts.values()), {k: v.detach() for k, v in parts.items()}


def slot_rows(targets: Tensor, batch_size: int, g: int) -> Tensor:
    """The row of ``targets`` (Tensor[N, 6]) in each padded slot (image * g + slot, as ``pad_targets`` fills
    them: an image's rows in their order), N at empty slots, and N once more at the end (Tensor[B * g + 1])."""
    n, device = len(targets), targets.device
    image = targets[:, 0].long()
    _, order = torch.sort(image, stable=True)
    counts = torch.zeros(batch_size, dtype=torch.long, device=device).index_add_(0, image, torch.ones_like(image))
    starts = counts.cumsum(0) - counts
    slot = torch.arange(n, device=device) - starts[image[order]]
    row_of = torch.full((batch_size * g + 1,), n, dtype=torch.long, device=device)
    row_of[image[order] * g + slot] = order
    return row_of


def _rows_as_given(point_row: Tensor, targets: Tensor, batch_size: int, g: int
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Each point's GT as a row of ``targets`` rather than a padded slot (N at background), and the rows'
    image, class and box."""
    row_of = slot_rows(targets, batch_size, g)
    return row_of[point_row.clamp(max=batch_size * g)], targets[:, 0].long(), targets[:, 1].long(), targets[:, 2:6]
