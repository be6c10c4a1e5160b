"""YOLO26-seg's loss: YOLO26's two branches, each with the mask and semantic terms, assigned by the quality of
the predicted masks as well as the boxes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from yolokit.losses.assigners import MaskInputs
from yolokit.losses.base import PaddedTargets
from yolokit.losses.masks import object_ranks
from yolokit.losses.yolo26 import BRANCHES, YOLO26BranchLoss, YOLO26Loss
from yolokit.losses.yolov8_seg import flat_coefficients, slot_rows, with_mask_terms


class YOLO26SegBranchLoss(YOLO26BranchLoss):
    """One branch of YOLO26-seg's loss: :class:`YOLO26BranchLoss`'s terms on a mask-aware assignment (each
    (GT, point) pair's overlap the mean of its box CIoU and its predicted mask's IoU with the GT's mask:
    :class:`~yolokit.losses.assigners.MaskInputs`), then the mask and semantic terms of
    :class:`~yolokit.losses.YOLOv8SegLoss`.

    Args: those of :class:`YOLO26BranchLoss`, and ``num_masks``, ``overlap`` and ``seg`` as
    :class:`~yolokit.losses.YOLOv8SegLoss`'s.
    """

    def __init__(self, num_classes: int, strides: Sequence[int], *, num_masks: int = 32, overlap: bool = True,
                 seg: float | None = None, **kwargs):
        super().__init__(num_classes, strides, **kwargs)
        self.num_masks, self.overlap = num_masks, overlap
        self.gains["seg"] = self.gains["box"] if seg is None else seg

    def _loss(self, maps: list[Tensor], targets: Tensor | PaddedTargets, max_boxes: int | None, *,
              coefficients: Tensor, protos: Tensor, semantic: Tensor | None, masks: Tensor
              ) -> tuple[Tensor, dict[str, Tensor]]:
        b = maps[0].shape[0]
        h, w = protos.shape[-2:]
        height = maps[0].shape[-2] * self.strides[0]

        def mask_inputs(gt: tuple) -> MaskInputs:
            return MaskInputs(coefficients.detach().transpose(1, 2), protos.detach().float(), h / height,
                              gt_row_masks(masks, gt[0], targets, b, max_boxes, (h, w), overlap=self.overlap))

        parts, assigned, gt = self._terms(maps, targets, max_boxes, mask_inputs)
        return with_mask_terms(self, parts, assigned.point_row, gt, maps, targets, max_boxes, coefficients, protos,
                               semantic, masks)


def gt_row_masks(masks: Tensor, image: Tensor, targets: Tensor | PaddedTargets, batch_size: int,
                 max_boxes: int | None, size: tuple[int, int], *, overlap: bool) -> Tensor:
    """The mask of each GT row the assigner sees (Tensor[rows, h, w] bool, at the prototypes' ``size``, masks
    of another size resized to it by nearest neighbour): the targets' rows, or padded slots (empty ones
    empty). ``image``: Tensor[rows] each row's image; ``masks`` as :class:`YOLO26SegLoss` takes them."""
    if masks.shape[-2:] != size:
        flat = masks.float().reshape(-1, *masks.shape[-2:])
        masks = F.interpolate(flat[None], size, mode="nearest")[0].view(*masks.shape[:-2], *size)
    if overlap:                                     # [B, h, w] index maps: row k of an image is k + 1
        return masks[image] == (object_ranks(image, batch_size) + 1)[:, None, None]
    if isinstance(targets, PaddedTargets):          # [B, G, h, w]: the slots themselves
        return masks.flatten(0, 1) > 0.5
    if max_boxes is None:                           # [N, h, w]: the rows themselves
        return masks > 0.5
    row_of = slot_rows(targets, batch_size, max_boxes)[:-1]
    n = len(targets)
    if n == 0:
        return torch.zeros(len(row_of), *size, dtype=torch.bool, device=masks.device)
    return (masks[row_of.clamp(max=n - 1)] > 0.5) & (row_of < n)[:, None, None]


class YOLO26SegLoss(YOLO26Loss):
    """YOLO26-seg's loss (the reference's end-to-end loss with its YOLO26 segmentation loss in each branch).

    ``forward(outputs, targets, masks=...)`` takes an ``EndToEndSegmentHead``'s training output: the
    branches' maps (``"one2many"``, ``"one2one"``), their coefficients (``"coefficients"``,
    ``"one2one_coefficients"``), ``"protos"`` and, with the semantic branch, ``"semantic"``. The one-to-many
    branch trains the prototypes and the semantic maps; the one-to-one branch sees them detached (its mask
    and semantic terms train only its own coefficients). ``total = o2m * L_one2many + o2o * L_one2one`` with
    the epoch's weights (:meth:`set_epoch`), each L = box + seg + cls + l1 (+ sem); ``parts`` are the
    one-to-one branch's, as the reference reports them.

    Args: those of :class:`YOLO26Loss`, and ``num_masks``, ``overlap`` and ``seg`` as
    :class:`~yolokit.losses.YOLOv8SegLoss`'s.
    """

    def __init__(self, num_classes: int, strides: Sequence[int], reg_max: int = 1, box: float = 7.5,
                 cls: float = 0.5, dfl: float = 1.5, topk: int = 10, one2one_topk: int = 7, one2one_topk2: int = 1,
                 start: float = 0.8, final: float = 0.1, min_gt_side: float | None = None, *, num_masks: int = 32,
                 overlap: bool = True, seg: float | None = None):
        super().__init__(num_classes, strides, reg_max, box, cls, dfl, topk, one2one_topk, one2one_topk2, start,
                         final, min_gt_side)
        common = {"num_classes": num_classes, "strides": strides, "reg_max": reg_max, "box": box, "cls": cls,
                  "dfl": dfl, "num_masks": num_masks, "overlap": overlap, "seg": seg, "min_gt_side": min_gt_side}
        self.one2many = YOLO26SegBranchLoss(**common, topk=topk)
        self.one2one = YOLO26SegBranchLoss(**common, topk=one2one_topk, topk2=one2one_topk2)
        self.num_masks, self.overlap = num_masks, overlap

    def branch_losses(self, outputs: Mapping[str, Tensor | Sequence[Tensor]], targets: Tensor | PaddedTargets, *,
                      masks: Tensor, max_boxes: int | None = None) -> dict[str, tuple[Tensor, dict[str, Tensor]]]:
        """Each branch's unweighted ``(total, parts)`` (gains applied; parts sum to the branch total)."""
        need = {*BRANCHES, "coefficients", "one2one_coefficients", "protos"}
        if not isinstance(outputs, Mapping) or not need <= set(outputs):
            got = sorted(outputs) if isinstance(outputs, Mapping) else type(outputs).__name__
            raise ValueError(f"YOLO26SegLoss takes the end-to-end seg head's dict with {sorted(need)}, got {got}")
        protos, semantic = outputs["protos"], outputs.get("semantic")
        if protos.ndim != 4 or protos.shape[1] != self.num_masks:
            raise ValueError(f"prototypes must be Tensor[B, num_masks={self.num_masks}, h, w], "
                             f"got {tuple(protos.shape)}")
        inputs = {"one2many": (outputs["coefficients"], protos, semantic),
                  "one2one": (outputs["one2one_coefficients"], protos.detach(),
                              None if semantic is None else semantic.detach())}
        out = {}
        for name in BRANCHES:
            coefficients, p, s = inputs[name]
            out[name] = getattr(self, name)(outputs[name], targets, max_boxes=max_boxes, masks=masks, protos=p,
                                            semantic=s, coefficients=flat_coefficients(coefficients))
        return out

    def forward(self, outputs: Mapping[str, Tensor | Sequence[Tensor]], targets: Tensor | PaddedTargets, *,
                masks: Tensor, max_boxes: int | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """Loss of one batch: ``(o2m * L_one2many + o2o * L_one2one, the one-to-one branch's parts)``.

        Args:
            outputs: the head's training dict (see the class).
            targets, max_boxes, masks: as :meth:`YOLOv8SegLoss.forward`.
        """
        losses = self.branch_losses(outputs, targets, masks=masks, max_boxes=max_boxes)
        (many, _), (one, parts) = losses["one2many"], losses["one2one"]
        o2m, o2o = self.epoch_weights
        return many * o2m + one * o2o, parts
