"""Non-maximum suppression over decoded predictions, and the per-image ``Detections``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class Detections:
    """Detections of one image.

    Attributes:
        boxes: Tensor[K, 4] (or ndarray) xyxy in pixels.
        scores: Tensor[K] confidence in [0, 1].
        labels: Tensor[K] int64 class indices.
        masks: a segmentation model's: Tensor[K, H, W] bool (or ndarray), each detection's mask in the same
            pixels as its box (the original image's, from ``Detector.predict`` with ``orig_shapes``), or
            ``ops.masks.MaskCrops`` (``mask_form="crops"``); None for a detection model.
    """

    boxes: Any
    scores: Any
    labels: Any
    masks: Any = None

    def __len__(self) -> int:
        return len(self.scores)

    def numpy(self) -> Detections:
        """The same detections as numpy arrays (float32 boxes and scores, int64 labels)."""
        if not isinstance(self.scores, Tensor):
            return self
        return Detections(
            self.boxes.detach().cpu().float().numpy(),
            self.scores.detach().cpu().float().numpy(),
            self.labels.detach().cpu().long().numpy(),
            None if self.masks is None else self.masks.detach().cpu().bool().numpy() if isinstance(self.masks, Tensor)
            else self.masks.to("cpu"),      # ops.masks.MaskCrops: its crops on the CPU
        )

    def to(self, device: torch.device | str) -> Detections:
        """The same detections on ``device`` (tensors only)."""
        return Detections(self.boxes.to(device), self.scores.to(device), self.labels.to(device),
                          None if self.masks is None else self.masks.to(device))

    def __repr__(self) -> str:
        rows = []
        shown = (self.boxes[:10].tolist(), self.scores[:10].tolist(), self.labels[:10].tolist())
        for box, score, label in zip(*shown, strict=True):
            coords = ", ".join(f"{v:.1f}" for v in box)
            shown = f"{score:.3f}" if score >= 1e-3 or score == 0 else f"{score:.1e}"
            rows.append(f"  label={int(label)} score={shown} box=[{coords}]")
        more = [f"  ... {len(self) - 10} more"] if len(self) > 10 else []
        return "\n".join([f"Detections(n={len(self)})", *rows, *more])


def non_max_suppression(
    predictions: Tensor,
    *,
    conf: float = 0.25,
    iou: float = 0.7,
    classes: Sequence[int] | None = None,
    agnostic: bool = False,
    multi_label: bool = False,
    max_det: int = 300,
    max_candidates: int = 30000,
) -> list[Detections]:
    """Per-image NMS of decoded predictions.

    Args:
        predictions: Tensor[B, P, 4 + C]: xyxy boxes in pixels, then class scores in [0, 1]
            (``Detector.decode`` output).
        conf: keep candidates whose score is strictly above this.
        iou: suppress boxes overlapping a higher-scoring one by more than this IoU.
        classes: keep only these class indices.
        agnostic: suppress across classes (one box per place whatever its class).
        multi_label: a point may yield one candidate per class above ``conf``; otherwise
            only its best class.
        max_det: at most this many detections per image, highest scores first.
        max_candidates: at most this many candidates per image enter NMS.

    Returns:
        A list of B ``Detections`` with float32 boxes and scores, int64 labels.
    """
    return [d for d, _ in nms_points(predictions, conf=conf, iou=iou, classes=classes, agnostic=agnostic,
                                     multi_label=multi_label, max_det=max_det, max_candidates=max_candidates)]


def nms_points(predictions: Tensor, *, conf: float = 0.25, iou: float = 0.7, classes: Sequence[int] | None = None,
               agnostic: bool = False, multi_label: bool = False, max_det: int = 300, max_candidates: int = 30000,
               ) -> list[tuple[Detections, Tensor]]:
    """``non_max_suppression``, each image's detections with the prediction (point) index each came from,
    Tensor[K] int64: what a segmentation head's mask coefficients are read by."""
    if predictions.ndim != 3 or predictions.shape[-1] < 5:
        raise ValueError(f"predictions must be Tensor[B, P, 4 + C], got shape {tuple(predictions.shape)}")
    if not 0.0 <= iou <= 1.0:
        raise ValueError(f"iou threshold must be in [0, 1], got {iou}")
    allowed = None if classes is None else torch.as_tensor(list(classes), device=predictions.device)
    results = []
    for pred in predictions.float():
        boxes, scores = pred[:, :4], pred[:, 4:]
        if multi_label:
            point, label = (scores > conf).nonzero(as_tuple=True)
            boxes, score = boxes[point], scores[point, label]
        else:
            score, label = scores.max(dim=1)
            point = (score > conf).nonzero().flatten()
            boxes, score, label = boxes[point], score[point], label[point]
        if allowed is not None:
            keep = torch.isin(label, allowed)
            boxes, score, label, point = boxes[keep], score[keep], label[keep], point[keep]
        if score.numel() > max_candidates:
            top = score.topk(max_candidates).indices
            boxes, score, label, point = boxes[top], score[top], label[top], point[top]
        groups = torch.zeros_like(label) if agnostic else label
        keep = _best_kept(boxes, score, groups, iou, max_det)
        results.append((Detections(boxes[keep], score[keep], label[keep].long()), point[keep]))
    return results


def _best_kept(boxes: Tensor, scores: Tensor, groups: Tensor, iou: float, max_det: int) -> Tensor:
    """Indices of the ``max_det`` best boxes greedy NMS keeps, best first.

    Greedy NMS decides about a box from the higher-scoring boxes only, so NMS over the
    ``m`` best candidates keeps exactly the first boxes that NMS over all of them keeps.
    Starting from ``m = 2 * max_det`` and growing it until ``max_det`` boxes are kept
    gives the same result as one NMS over every candidate, at a fraction of its
    quadratic cost when the candidates are many (low ``conf``).
    """
    from torchvision.ops import batched_nms  # here, not at import: torchvision's import costs 1-2 s

    n = scores.numel()
    m = min(n, 2 * max_det)
    if m == n:
        return batched_nms(boxes, scores, groups, iou)[:max_det]
    order = scores.argsort(descending=True)
    while True:
        best = order[:m]
        keep = batched_nms(boxes[best], scores[best], groups[best], iou)
        if len(keep) >= max_det or m == n:
            return best[keep[:max_det]]
        m = min(n, 4 * m)


def detection_rows(predictions: Tensor, *, conf: float = 0.25, iou: float = 0.7, max_det: int = 300) -> Tensor:
    """NMS in one graph for a whole batch, as ONNX's NonMaxSuppression does it: Tensor[B, P, 4 + C] ->
    Tensor[K, 7] rows (image, x1, y1, x2, y2, score, class), best first within each image and class.

    Each point keeps its best class; the points scoring above ``conf`` go through one greedy NMS at
    ``iou`` per (image, class) (boxes moved apart by group, as ``batched_nms`` does), and each
    (image, class) keeps at most ``max_det`` rows. Written for ``torch.export``: no Python loop over
    images or classes and no ``len()`` of a data-dependent size, so a dynamic batch stays dynamic.
    """
    from torchvision.ops import nms

    b, p = predictions.shape[:2]
    scores, labels = predictions[..., 4:].max(dim=-1)                                  # [B, P]
    image = torch.arange(b, device=predictions.device)[:, None].expand(b, p)
    keep = scores > conf
    boxes, scores, labels, image = predictions[..., :4][keep], scores[keep], labels[keep], image[keep]
    group = image * (predictions.shape[-1] - 4) + labels
    apart = group.to(boxes.dtype)[:, None] * (predictions[..., :4].amax() + 1)      # over all: never empty
    # two stand-ins, kept whatever else is (beyond every box, scores below any): torchvision's traced nms
    # promises at least two boxes kept, and without them a graph that keeps 0 or 1 fails that assertion
    stand_ins = predictions[..., :4].amin() + predictions.new_tensor([[-3.0, -3.0, -2.0, -2.0],
                                                                       [-5.0, -5.0, -4.0, -4.0]])
    kept = nms(torch.cat((boxes + apart, stand_ins)), torch.cat((scores, scores.new_full((2,), -1.0))), iou)
    kept = kept[kept < scores.shape[0]]                                               # best first
    order = torch.sort(group[kept], stable=True).indices
    grouped = group[kept][order]
    rank = torch.ones_like(grouped).cumsum(0) - 1 - torch.searchsorted(grouped, grouped)   # within its group
    capped = torch.zeros_like(kept, dtype=torch.bool)
    capped[order] = rank < max_det
    kept = kept[capped]
    return torch.cat((image[kept, None].to(boxes.dtype), boxes[kept], scores[kept, None],
                      labels[kept, None].to(boxes.dtype)), dim=1)


def top_k_predictions(predictions: Tensor, *, max_det: int = 300, agnostic: bool = False) -> Tensor:
    """The ``max_det`` best (point, class) pairs of each image, without NMS: an end-to-end head's output.

    Args:
        predictions: Tensor[B, P, 4 + C] (``Detector.decode`` of a one-to-one branch).
        max_det: pairs kept per image (k = min(max_det, P)).
        agnostic: each point's best class only, so a point appears at most once. Otherwise the k
            points whose best score is highest are taken first, then the k best of their k x C
            (point, class) pairs: a point may appear once per class.

    Returns:
        Tensor[B, k, 6]: ``x1, y1, x2, y2, score, class`` rows, highest score first (the class as a
        float, as the exported graph gives it).
    """
    if predictions.ndim != 3 or predictions.shape[-1] < 5:
        raise ValueError(f"predictions must be Tensor[B, P, 4 + C], got shape {tuple(predictions.shape)}")
    if isinstance(max_det, bool) or not isinstance(max_det, int) or max_det < 1:
        raise ValueError(f"max_det must be a positive integer, got {max_det!r}")
    return top_k_points(predictions, max_det=max_det, agnostic=agnostic)[0]


def top_k_points(predictions: Tensor, *, max_det: int = 300, agnostic: bool = False) -> tuple[Tensor, Tensor]:
    """``top_k_predictions``'s rows, and the point each row came from: Tensor[B, k] int64."""
    boxes, scores = predictions[..., :4], predictions[..., 4:]
    k, classes = min(max_det, scores.shape[1]), scores.shape[2]

    def rows(index: Tensor, values: Tensor) -> Tensor:   # values[b, index[b, j]] (a Gather that OpenVINO
        batch = torch.arange(values.shape[0], device=values.device)[:, None]   # sizes for any H and W)
        return values[batch, index]

    best, label = scores.max(dim=-1)
    if agnostic:
        score, point = best.topk(k, dim=1)
        return torch.cat((rows(point, boxes), score[..., None], label.gather(1, point)[..., None].to(score.dtype)),
                         dim=-1), point
    points = best.topk(k, dim=1).indices                         # the k points with the best scores
    score, pair = rows(points, scores).flatten(1).topk(k, dim=1)  # the k best of their (point, class) pairs
    point = points.gather(1, torch.div(pair, classes, rounding_mode="floor"))
    return torch.cat((rows(point, boxes), score[..., None], (pair % classes)[..., None].to(score.dtype)),
                     dim=-1), point


def end_to_end_detections(predictions: Tensor, *, conf: float = 0.25, classes: Sequence[int] | None = None,
                          max_det: int = 300, agnostic: bool = False) -> list[Detections]:
    """Per-image detections of an end-to-end (one-to-one) branch: ``top_k_predictions``, then those scoring
    above ``conf`` (and of ``classes``), best first. No NMS: the branch was trained to give one point per
    object.

    Args:
        predictions: Tensor[B, P, 4 + C] (``Detector.decode(maps, branch="one2one")``).
        conf: keep pairs whose score is strictly above this.
        classes: keep only these class indices (applied after the top-k, as the reference does).
        max_det: the k of the top-k.
        agnostic: one class per point (see ``top_k_predictions``).
    """
    return [d for d, _ in end_to_end_points(predictions, conf=conf, classes=classes, max_det=max_det,
                                            agnostic=agnostic)]


def end_to_end_points(predictions: Tensor, *, conf: float = 0.25, classes: Sequence[int] | None = None,
                      max_det: int = 300, agnostic: bool = False) -> list[tuple[Detections, Tensor]]:
    """``end_to_end_detections``, each image's with the point each detection came from (Tensor[K] int64)."""
    if predictions.ndim != 3 or predictions.shape[-1] < 5:
        raise ValueError(f"predictions must be Tensor[B, P, 4 + C], got shape {tuple(predictions.shape)}")
    allowed = None if classes is None else torch.as_tensor(list(classes), device=predictions.device)
    results = []
    for rows, point in zip(*top_k_points(predictions.float(), max_det=max_det, agnostic=agnostic), strict=True):
        keep = rows[:, 4] > conf
        if allowed is not None:
            keep &= torch.isin(rows[:, 5].long(), allowed)
        kept = rows[keep]
        results.append((Detections(kept[:, :4], kept[:, 4], kept[:, 5].long()), point[keep]))
    return results
