"""The instance segmentation term: each positive point's mask, from its coefficients and its image's
prototypes, against the mask of the object it trains, inside that object's box.

For a positive point with coefficients c (Tensor[M]) in an image with prototypes P (Tensor[M, h, w]),
the mask logits are ``c @ P`` (Tensor[h, w]). Its term is the binary cross-entropy of those logits
against the object's mask, zeroed outside the object's box (in mask pixels), averaged over all h * w
pixels and divided by the box's area as a fraction of the image: a small object weighs as much as a
large one. The loss is the mean of the terms over the positive points (YOLOv8-seg's, before its gain).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from yolokit.ops.masks import box_window


def object_ranks(image: Tensor, batch_size: int) -> Tensor:
    """Each GT row's index among its image's rows, in row order: the value ``rank + 1`` marks it in an
    image's index map (``overlap`` masks). Tensor[N] int64."""
    one_hot = image[:, None] == torch.arange(batch_size, device=image.device)
    return one_hot.long().cumsum(0)[torch.arange(len(image), device=image.device), image] - 1


def mask_loss(coefficients: Tensor, protos: Tensor, point_row: Tensor, gt_image: Tensor, gt_boxes: Tensor,
              masks: Tensor, imgsz: tuple[int, int], *, overlap: bool = True) -> Tensor:
    """The mask term over a batch's positive points (scalar, before the gain).

    Args:
        coefficients: Tensor[B, M, P] each point's mask coefficients (the levels flattened in order).
        protos: Tensor[B, M, h, w] each image's prototypes.
        point_row: Tensor[B, P] int64 the GT row each point trains; N (the rows' count) at background.
        gt_image: Tensor[N] int64 image of each GT row.
        gt_boxes: Tensor[N, 4] xyxy input pixels.
        masks: ``overlap``: Tensor[B, H', W'] index maps, ``k + 1`` where the image's k-th GT row (in row
            order) lies, 0 elsewhere; else Tensor[N, H', W'] one 0/1 mask per GT row. At another size
            than the prototypes', the prototypes are resized to it (bilinear).
        imgsz: (height, width) of the network's input.
        overlap: which form ``masks`` has.

    Returns:
        The mean over positive points of each one's cropped BCE (mean over pixels) / its box's area
        fraction; a zero connected to both inputs when no point is positive.
    """
    b, n = coefficients.shape[0], len(gt_image)
    coefficients, protos = coefficients.float(), protos.float()
    if masks.shape[-2:] != protos.shape[-2:]:
        protos = F.interpolate(protos, masks.shape[-2:], mode="bilinear", align_corners=False)
    h, w = protos.shape[-2:]
    height, width = imgsz
    ranks = object_ranks(gt_image, b) if overlap else None
    image_size = gt_boxes.new_tensor([width, height, width, height], dtype=torch.float32)
    mask_size = gt_boxes.new_tensor([w, h, w, h], dtype=torch.float32)
    total, count = coefficients.new_zeros(()), 0
    positive = point_row < n
    points = positive.nonzero()[:, 1]                               # the batch's positives, image by image
    counts = positive.sum(1).tolist()                               # two reads of the device a batch, not B
    # unbind: one backward node stacks the images' gradients (a select per image would write a zero-filled
    # gradient of the whole batch's prototypes for each image)
    for i, (coef, proto, point) in enumerate(zip(coefficients.unbind(0), protos.unbind(0), points.split(counts),
                                                 strict=True)):
        if not len(point):
            continue
        row = point_row[i, point]
        logits = (coef[:, point].T @ proto.flatten(1)).view(-1, h, w)
        target = (masks[i] == (ranks[row] + 1)[:, None, None]) if overlap else masks[row]
        bce = F.binary_cross_entropy_with_logits(logits, target.float(), reduction="none")
        box = gt_boxes[row].float() / image_size                    # fractions of the image, then mask pixels
        cols, rows = box_window(box * mask_size, h, w)
        area = (box[:, 2] - box[:, 0]) * (box[:, 3] - box[:, 1])
        inside = (rows.transpose(1, 2) @ bce @ cols.transpose(1, 2)).view(-1)   # the BCE summed inside the box
        total = total + (inside / (h * w) / area).sum()
        count += len(point)
    if count == 0:
        return (protos * 0).sum() + (coefficients * 0).sum()
    return total / count


def semantic_targets(masks: Tensor, gt_image: Tensor, gt_labels: Tensor, batch_size: int, num_classes: int, *,
                     overlap: bool = True) -> Tensor:
    """One map per class of each image, 1 where an object of that class covers the pixel (Tensor[B, C, H', W']).

    A pixel takes the class of the object drawn there (``overlap``: the index map's object); with one mask
    per object, of the smallest object covering it (fewest mask pixels; the earlier row on a tie).
    Uncovered pixels are 0 in every class.

    Args:
        masks: as :func:`mask_loss` takes them, Tensor[B, H', W'] index maps or Tensor[N, H', W'] masks.
        gt_image, gt_labels: Tensor[N] int64 image and class of each GT row.
    """
    device, n = masks.device, len(gt_image)
    if overlap:
        table = torch.zeros(batch_size, n + 1, dtype=torch.long, device=device)   # [image, rank + 1] -> class
        table[gt_image, object_ranks(gt_image, batch_size) + 1] = gt_labels
        index = masks.long().clamp(0, n)
        classes = table.gather(1, index.flatten(1)).view_as(index)
        present = index > 0
    else:
        h, w = masks.shape[-2:]
        covered = masks > 0.5
        area = covered.flatten(1).sum(1)
        key = area[:, None, None] * (n + 1) + torch.arange(n, device=device)[:, None, None]   # smallest, then first
        none = (h * w + 1) * (n + 1)
        key = torch.where(covered, key, none)
        best = torch.full((batch_size, h, w), none, dtype=torch.long, device=device)
        best.scatter_reduce_(0, gt_image[:, None, None].expand(n, h, w), key, "amin")
        present = best < none
        classes = torch.where(present, gt_labels[(best % (n + 1)).clamp(max=max(n - 1, 0))] if n else 0, 0)
    target = torch.zeros(batch_size, num_classes, *masks.shape[-2:], device=device)
    return target.scatter_(1, classes[:, None], present[:, None].float())


def semantic_loss(logits: Tensor, target: Tensor) -> Tensor:
    """YOLO26-seg's semantic term (before its gain): half the mean BCE with logits, half the Dice loss (each
    class map's ``1 - (2 I + 1) / (P + T + 1)`` over its pixels, averaged over classes, then images).

    Args:
        logits: Tensor[B, C, h, w] the semantic branch's maps.
        target: Tensor[B, C, H', W'] from :func:`semantic_targets`; resized to (h, w) (nearest) at another size.
    """
    logits = logits.float()
    if target.shape[-2:] != logits.shape[-2:]:
        target = F.interpolate(target, logits.shape[-2:], mode="nearest")
    bce = F.binary_cross_entropy_with_logits(logits, target)
    p = logits.sigmoid()
    dice = (2.0 * (p * target).sum((2, 3)) + 1.0) / (p.sum((2, 3)) + target.sum((2, 3)) + 1.0)
    return 0.5 * bce + 0.5 * (1.0 - dice).mean()
