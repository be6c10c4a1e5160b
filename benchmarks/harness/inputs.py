"""The inputs every benchmark case shares between yolokit and the reference.

All of them are drawn from seeded generators, so both sides see the same tensors and
every run of the benchmark sees the same ones too.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

STRIDES = (8, 16, 32)


def random_targets(batch: int, per_image: int, size: int, *, classes: int = 80, min_wh: float = 16.0,
                   max_wh: float = 320.0, seed: int = 0) -> Tensor:
    """Tensor[B * per_image, 6] rows ``(image_index, class, x1, y1, x2, y2)`` inside a ``size`` square."""
    gen = torch.Generator().manual_seed(seed)
    n = batch * per_image
    wh = min_wh + torch.rand(n, 2, generator=gen) * (min(max_wh, size) - min_wh)
    xy = torch.rand(n, 2, generator=gen) * (size - wh)
    image = torch.arange(batch).repeat_interleave(per_image).float()
    cls = torch.randint(0, classes, (n,), generator=gen).float()
    return torch.cat([image[:, None], cls[:, None], xy, xy + wh], dim=1)


def random_images(batch: int, size: int, *, seed: int = 0) -> Tensor:
    """Tensor[B, 3, size, size] float in [0, 1]."""
    return torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


def v8_maps(batch: int, size: int, *, classes: int = 80, reg_max: int = 16, seed: int = 0,
            box_scale: float = 1.0, cls_mean: float = 0.0, cls_std: float = 1.0) -> list[Tensor]:
    """Raw YOLOv8 head maps, per level Tensor[B, 4 * reg_max + C, size / s, size / s].

    Box channels are N(0, box_scale^2) logits, class channels N(cls_mean, cls_std^2).
    """
    gen = torch.Generator().manual_seed(seed)
    maps = []
    for s in STRIDES:
        h = w = size // s
        box = torch.randn(batch, 4 * reg_max, h, w, generator=gen) * box_scale
        cls = torch.randn(batch, classes, h, w, generator=gen) * cls_std + cls_mean
        maps.append(torch.cat([box, cls], 1))
    return maps


def detection_like_maps(size: int = 640, *, classes: int = 80, seed: int = 0) -> list[Tensor]:
    """Raw maps of one image whose scores look like a trained detector's at a low threshold.

    Class logits N(-11, 1.5^2): about a quarter of the points have a best score above
    0.001, as with a COCO-trained yolov8n on a busy image; box logits N(0, 3^2) give
    peaked distance distributions, so boxes of all sizes overlap and NMS has real work.
    """
    return v8_maps(1, size, classes=classes, seed=seed, box_scale=3.0, cls_mean=-11.0, cls_std=1.5)


def evaluation_set(images: int, *, classes: int = 80, max_gt: int = 15, max_det: int = 100, seed: int = 0,
                   shape: tuple[int, int] = (480, 640)) -> list[dict[str, np.ndarray]]:
    """A validation set with predictions: per image its ground truth and ranked detections.

    Each GT gets 0 to 3 jittered detections (its class 4 times in 5), and random false
    positives fill up to ``max_det``; detections are sorted by descending score, as NMS
    returns them.

    Returns:
        Per image a dict: ``gt_boxes`` float32 [G, 4] xyxy, ``gt_labels`` int64 [G],
        ``boxes`` float32 [K, 4] xyxy, ``scores`` float32 [K], ``labels`` int64 [K], ``shape`` (h, w).
    """
    rng = np.random.default_rng(seed)
    h, w = shape
    out = []
    for _ in range(images):
        g = int(rng.integers(0, max_gt + 1))
        wh = rng.uniform(8, 200, (g, 2))
        xy = rng.uniform(0, 1, (g, 2)) * (np.array([w, h]) - wh)
        gt = np.concatenate([xy, xy + wh], 1)
        gt_labels = rng.integers(0, classes, g)
        copies = rng.integers(0, 4, g)
        src = np.repeat(np.arange(g), copies)
        jitter = rng.normal(0, 0.08, (len(src), 4)) * np.tile(wh[src], 2)
        boxes = gt[src] + jitter
        labels = np.where(rng.random(len(src)) < 0.8, gt_labels[src], rng.integers(0, classes, len(src)))
        scores = rng.uniform(0.05, 1.0, len(src))
        n_fp = int(rng.integers(0, max(1, max_det - len(src))))
        fwh = rng.uniform(8, 200, (n_fp, 2))
        fxy = rng.uniform(0, 1, (n_fp, 2)) * (np.array([w, h]) - fwh)
        boxes = np.concatenate([boxes, np.concatenate([fxy, fxy + fwh], 1)])
        labels = np.concatenate([labels, rng.integers(0, classes, n_fp)])
        scores = np.concatenate([scores, rng.uniform(0.001, 0.3, n_fp)])
        order = np.argsort(-scores, kind="stable")[:max_det]
        out.append({"gt_boxes": gt.astype(np.float32), "gt_labels": gt_labels.astype(np.int64),
                    "boxes": boxes[order].astype(np.float32), "scores": scores[order].astype(np.float32),
                    "labels": labels[order].astype(np.int64), "shape": (h, w)})
    return out


def box_masks(targets: Tensor, batch: int, size: int, *, ratio: int = 4) -> Tensor:
    """A segmentation batch's masks for ``random_targets``: one uint8 index map per image at ``size / ratio``
    (``overlap_mask``, the trainer's default), each row's box filled with ``k + 1`` (its rank in its image)."""
    side = size // ratio
    masks = torch.zeros(batch, side, side, dtype=torch.uint8)
    ranks: dict[int, int] = {}
    for image, _, x1, y1, x2, y2 in targets.tolist():
        k = ranks[int(image)] = ranks.get(int(image), 0) + 1
        masks[int(image), int(y1) // ratio:int(y2) // ratio + 1, int(x1) // ratio:int(x2) // ratio + 1] = k
    return masks
