"""COCO box evaluation, array at a time: pycocotools' ``COCOeval`` numbers without its Python loops.

``COCOeval`` walks every (image, class, area range) in Python and matches detections
one by one; on a validation set that costs seconds. This module runs the same
algorithm on flat arrays:

* per (image, class) the detections are ranked by score (stable) and cut at 100,
  exactly as ``computeIoU`` does, and IoUs are computed with the formulas of
  pycocotools' C ``bbIou`` (same operations, same order, so the same float64 bits);
* greedy matching goes rank by rank: every (image, class) group, IoU threshold and
  area range advances together, and within a group a detection takes the unmatched
  ground truth of highest IoU (ties: the later one, ignored boxes only when no regular
  box qualifies), which is ``evaluateImg``'s inner loop;
* accumulation sorts each class's detections by score (stable over image then rank,
  as ``accumulate`` concatenates them), takes running TP/FP counts, and reads the
  precision envelope at the 101 recall points through exact integer arithmetic.

The result is ``COCOeval.eval["precision"]``/``["recall"]`` and ``stats`` with the
standard parameters (IoU 0.50:0.05:0.95, 101 recall points, max detections 1/10/100,
areas all/small/medium/large), equal to pycocotools' to the last bit; the test suite
checks that on randomized sets. Ground truth here is never crowd (``iscrowd`` 0).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

IOU_THRESHOLDS = np.linspace(0.5, 0.95, int(np.round((0.95 - 0.5) / 0.05)) + 1, endpoint=True)
RECALL_THRESHOLDS = np.linspace(0.0, 1.00, int(np.round((1.00 - 0.0) / 0.01)) + 1, endpoint=True)
MAX_DETS = (1, 10, 100)
AREA_RANGES = ((0.0**2, 1e5**2), (0.0**2, 32.0**2), (32.0**2, 96.0**2), (96.0**2, 1e5**2))


@dataclass
class BoxEval:
    """The accumulated evaluation, laid out as pycocotools' ``COCOeval.eval``.

    Attributes:
        precision: [T, R, K, A] interpolated precision at 100 detections per image and
            class (``eval["precision"][..., -1]``), -1 where a class has no non-ignored
            ground truth in that area range. (The 1- and 10-detection precision, which no
            summary number reads, is not computed.)
        recall: [T, K, A, M] final recall, -1 likewise.
        stats: the 12 numbers of ``COCOeval.summarize()``.
    """

    precision: np.ndarray
    recall: np.ndarray
    stats: np.ndarray


def evaluate_boxes(
    gt_boxes: np.ndarray,
    gt_labels: np.ndarray,
    gt_images: np.ndarray,
    det_boxes: np.ndarray,
    det_scores: np.ndarray,
    det_labels: np.ndarray,
    det_images: np.ndarray,
    num_classes: int,
) -> BoxEval:
    """Scores detections against ground truth the way ``COCOeval(..., "bbox")`` does.

    Detections of equal score are ordered as pycocotools orders them: by image id, then
    by their order in the input within an image.

    Args:
        gt_boxes: [G, 4] xyxy boxes in pixels.
        gt_labels: [G] class indices in ``[0, num_classes)``.
        gt_images: [G] image ids (any integers; images are taken in ascending order).
        det_boxes: [D, 4] xyxy boxes in pixels.
        det_scores: [D] confidences.
        det_labels: [D] class indices.
        det_images: [D] image ids.
        num_classes: K.

    Returns:
        ``BoxEval``.
    """
    gt_xywh, det_xywh = _xywh(gt_boxes), _xywh(det_boxes)
    sizes = [np.asarray(x).size for x in (gt_labels, gt_images, det_scores, det_labels, det_images)]
    if not len(gt_xywh) == sizes[0] == sizes[1]:
        raise ValueError(f"ground truth: {len(gt_xywh)} boxes, {sizes[0]} labels, {sizes[1]} image ids")
    if not len(det_xywh) == sizes[2] == sizes[3] == sizes[4]:
        raise ValueError(f"detections: {len(det_xywh)} boxes, {sizes[2]} scores, {sizes[3]} labels, "
                         f"{sizes[4]} image ids")
    return evaluate(gt_labels, gt_images, det_scores, det_labels, det_images, num_classes,
                    gt_area=gt_xywh[:, 2] * gt_xywh[:, 3], det_area=det_xywh[:, 2] * det_xywh[:, 3],
                    pair_iou=lambda d, g: _pair_iou(det_xywh[d], gt_xywh[g]))


def evaluate(gt_labels: np.ndarray, gt_images: np.ndarray, det_scores: np.ndarray, det_labels: np.ndarray,
             det_images: np.ndarray, num_classes: int, *, gt_area: np.ndarray, det_area: np.ndarray,
             pair_iou: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> BoxEval:
    """``COCOeval``'s algorithm for any kind of instance: boxes (:func:`evaluate_boxes`), masks
    (:func:`evaluate_masks`).

    Args:
        gt_labels, gt_images, det_scores, det_labels, det_images, num_classes: as :func:`evaluate_boxes`.
        gt_area, det_area: [G] and [D] areas, for the area ranges (pycocotools: a ground truth's
            ``area`` field, a detection's box or mask area).
        pair_iou: ``pair_iou(det_index, gt_index)`` -> [P] float64 IoU of aligned pairs, indices into the
            inputs as given.
    """
    gt_labels, det_labels = np.asarray(gt_labels, np.int64).reshape(-1), np.asarray(det_labels, np.int64).reshape(-1)
    gt_images, det_images = np.asarray(gt_images, np.int64).reshape(-1), np.asarray(det_images, np.int64).reshape(-1)
    scores = np.asarray(det_scores, np.float64).reshape(-1)
    gt_area, det_area = np.asarray(gt_area, np.float64).reshape(-1), np.asarray(det_area, np.float64).reshape(-1)
    if not (len(gt_area) == len(gt_labels) == len(gt_images)):
        raise ValueError(f"ground truth: {len(gt_area)} areas, {len(gt_labels)} labels, {len(gt_images)} image ids")
    if not (len(det_area) == len(scores) == len(det_labels) == len(det_images)):
        raise ValueError(f"detections: {len(det_area)} areas, {len(scores)} scores, {len(det_labels)} labels, "
                         f"{len(det_images)} image ids")
    for name, labels in (("gt_labels", gt_labels), ("det_labels", det_labels)):
        if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
            raise ValueError(f"{name} must lie in [0, {num_classes}), got {labels.min()}..{labels.max()}")
    _, image = np.unique(np.concatenate([gt_images, det_images]), return_inverse=True)
    gt_image, det_image = image[: len(gt_images)], image[len(gt_images) :]

    # ground truth grouped by (image, class), annotation order kept within a group
    gt_key = gt_image * num_classes + gt_labels
    g_order = np.argsort(gt_key, kind="stable")
    gt_key, gt_labels, gt_area = gt_key[g_order], gt_labels[g_order], gt_area[g_order]

    # detections image-major, so that input order breaks score ties by (image, rank)
    det_index = np.arange(len(scores))
    if len(det_image) > 1 and (det_image[1:] < det_image[:-1]).any():
        o = np.argsort(det_image, kind="stable")
        det_index, scores, det_labels, det_image, det_area = det_index[o], scores[o], det_labels[o], det_image[o], \
            det_area[o]
    small = np.int16 if max(num_classes, int(image.max(initial=0)) + 1) < 2**15 else np.int64  # radix-sortable
    by_score = np.argsort(-scores, kind="stable")
    order = by_score[np.argsort(det_labels.astype(small)[by_score], kind="stable")]  # class, -score, index
    grouped = order[np.argsort(det_image.astype(small)[order], kind="stable")]  # image, class, -score, index
    det_key = det_image * num_classes + det_labels
    key = det_key[grouped]
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]]) if len(key) else np.zeros(0, np.int64)
    rank = np.empty(len(key), np.int64)
    rank[grouped] = np.arange(len(key)) - np.repeat(starts, np.diff(np.r_[starts, len(key)]))
    order = order[rank[order] < MAX_DETS[-1]]  # computeIoU keeps the best 100 per (image, class)
    det_key, det_labels, rank, det_area, det_index = det_key[order], det_labels[order], rank[order], \
        det_area[order], det_index[order]

    # everything below runs in accumulation order: class, then descending score
    gt_ignore = np.stack([(gt_area < lo) | (gt_area > hi) for lo, hi in AREA_RANGES])  # [A, G]
    det_outside = np.stack([(det_area < lo) | (det_area > hi) for lo, hi in AREA_RANGES])  # [A, D]
    matched, matched_ignored = _match(gt_key, gt_ignore, det_key, rank,
                                      lambda d, g: np.asarray(pair_iou(det_index[d], g_order[g]), np.float64))
    det_ignore = matched_ignored | (~matched & det_outside[:, None, :])  # [A, T, D]
    num_gt = np.stack([np.bincount(gt_labels[~ign], minlength=num_classes) for ign in gt_ignore])  # [A, K]
    precision, recall = _accumulate(det_labels, rank, matched, det_ignore, num_gt)
    return BoxEval(precision=precision, recall=recall, stats=summarize(precision, recall))


def _xywh(boxes: np.ndarray) -> np.ndarray:
    """xyxy to the [x, y, w, h] float64 boxes pycocotools is given (w = x2 - x1 in float64)."""
    b = np.asarray(boxes, np.float64).reshape(-1, 4)
    return np.stack([b[:, 0], b[:, 1], b[:, 2] - b[:, 0], b[:, 3] - b[:, 1]], 1)


def _pair_iou(d: np.ndarray, g: np.ndarray) -> np.ndarray:
    """IoU of aligned [P, 4] xywh pairs, operation for operation as pycocotools' ``bbIou`` (no crowd)."""
    w = np.minimum(d[:, 2] + d[:, 0], g[:, 2] + g[:, 0]) - np.maximum(d[:, 0], g[:, 0])
    h = np.minimum(d[:, 3] + d[:, 1], g[:, 3] + g[:, 1]) - np.maximum(d[:, 1], g[:, 1])
    inter = w * h
    union = d[:, 2] * d[:, 3] + g[:, 2] * g[:, 3] - inter
    with np.errstate(divide="ignore", invalid="ignore"):
        iou = inter / union
    return np.where((w > 0) & (h > 0), iou, 0.0)


def _match(gt_key: np.ndarray, gt_ignore: np.ndarray, det_key: np.ndarray, rank: np.ndarray,
           pair_iou: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Greedy matching of ``evaluateImg`` for every group, threshold and area range at once.

    A detection takes, among the ground truth boxes of its group not yet taken at that
    threshold with IoU >= the threshold, a non-ignored one if any, the highest IoU, and
    the later box on ties. That order is one integer key per (area range, pair), so each
    rank needs a single segmented max.

    Returns:
        ``(matched, matched_ignored)``, both [A, T, D]: the detection took a ground truth
        box at that threshold, and that box is ignored in that area range.
    """
    num_areas, num_thr, num_det = gt_ignore.shape[0], len(IOU_THRESHOLDS), len(det_key)
    matched = np.zeros((num_areas, num_thr, num_det), bool)
    matched_ignored = np.zeros((num_areas, num_thr, num_det), bool)
    g_lo = np.searchsorted(gt_key, det_key, "left")
    counts = np.searchsorted(gt_key, det_key, "right") - g_lo
    dets = np.flatnonzero(counts > 0)
    if not len(dets):
        return matched, matched_ignored
    dets = dets[np.argsort(rank[dets], kind="stable")]  # rank-major: each rank's pairs are one slice
    counts = counts[dets]
    pair_start = np.r_[0, np.cumsum(counts)]
    num_pairs = int(pair_start[-1])
    pair_det = np.repeat(dets, counts)
    pair_gt = np.repeat(g_lo[dets], counts) + np.arange(num_pairs) - np.repeat(pair_start[:-1], counts)
    pair_iou = pair_iou(pair_det, pair_gt)
    iou_code = np.unique(pair_iou, return_inverse=True)[1].reshape(-1)  # exact order of the IoUs
    levels = int(iou_code.max()) + 1
    preference = (iou_code + levels * ~gt_ignore[:, pair_gt]) * num_pairs + np.arange(num_pairs)  # [A, P]
    thresholds = np.minimum(IOU_THRESHOLDS, 1 - 1e-10)[None, :, None]
    gt_taken = np.zeros((num_areas, num_thr, len(gt_key)), bool)
    det_rank = rank[dets]
    bounds = np.searchsorted(det_rank, np.arange(det_rank.max() + 2))
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):  # one pass per rank: one detection per group
        if lo == hi:
            continue
        p0, p1 = pair_start[lo], pair_start[hi]
        gts = pair_gt[p0:p1]
        ok = ~gt_taken[:, :, gts] & (pair_iou[p0:p1] >= thresholds)  # [A, T, P]
        best = np.maximum.reduceat(np.where(ok, preference[:, None, p0:p1], -1), pair_start[lo:hi] - p0, axis=-1)
        a_i, t_i, n_i = np.nonzero(best >= 0)
        pair = best[a_i, t_i, n_i] % num_pairs
        g, d = pair_gt[pair], pair_det[pair]
        gt_taken[a_i, t_i, g] = True
        matched[a_i, t_i, d] = True
        matched_ignored[a_i, t_i, d] = gt_ignore[a_i, g]
    return matched, matched_ignored


def _accumulate(labels: np.ndarray, rank: np.ndarray, matched: np.ndarray, ignored: np.ndarray,
                num_gt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``accumulate``: precision [T, R, K, A] at 100 detections, recall [T, K, A, M].

    Args:
        labels: [N] class of each detection, sorted by class then score order.
        rank: [N] the detection's rank within its (image, class).
        matched, ignored: [A, T, N].
        num_gt: [A, K] non-ignored ground truth per area range and class.
    """
    num_areas, num_thr, n = matched.shape
    k = num_gt.shape[1]
    rows = num_areas * num_thr
    valid = ~ignored
    tp = matched & valid
    seg_lo = np.searchsorted(labels, np.arange(k), "left")
    valid_cum = np.concatenate([np.zeros((rows, 1), np.int32),
                                np.cumsum(valid.reshape(rows, n), axis=-1, dtype=np.int32)], -1)
    # every true positive in (area, threshold, position) order, i.e. (row, class, count) order
    flat = np.flatnonzero(tp)
    row, pos = np.divmod(flat, n)
    segment = row * k + labels[pos]
    bounds = np.searchsorted(segment, np.arange(rows * k + 1))
    first_tp, tp_total = bounds[:-1], np.diff(bounds)
    count = np.arange(len(flat)) - first_tp[segment] + 1
    seen = valid_cum[row, pos + 1] - valid_cum[row, seg_lo[labels[pos]]]  # valid detections up to here
    count_f = count.astype(np.float64)
    pr = count_f / ((seen - count).astype(np.float64) + count_f + np.spacing(1))
    envelope = _segment_suffix_max(pr, segment)

    has_gt = (num_gt > 0)[:, None, :]  # [A, 1, K]
    recall = -np.ones((num_thr, k, num_areas, len(MAX_DETS)))
    for mi, max_det in enumerate(MAX_DETS):
        found = tp_total if max_det == MAX_DETS[-1] else np.bincount(
            segment[rank[pos] < max_det], minlength=rows * k)
        with np.errstate(divide="ignore", invalid="ignore"):
            r = np.where(has_gt, found.reshape(num_areas, num_thr, k) / num_gt[:, None, :], -1.0)
        recall[..., mi] = r.transpose(1, 2, 0)

    # the first position where recall >= threshold holds the c-th true positive, c the least
    # count with fl(c / num_gt) >= threshold; c = 0 reads the first position, whose envelope
    # value is that of the first true positive (precision is 0 before it)
    need = np.maximum(_least_counts(num_gt), 1)[:, None]  # [A, 1, K, R]
    first_tp, tp_total = first_tp.reshape(num_areas, num_thr, k, 1), tp_total.reshape(num_areas, num_thr, k, 1)
    q = envelope[np.minimum(first_tp + need - 1, len(envelope) - 1)] if len(envelope) else np.zeros(need.shape)
    q = np.where((need <= tp_total) & has_gt[..., None], q, np.where(has_gt[..., None], 0.0, -1.0))
    return q.transpose(1, 3, 2, 0), recall  # [A, T, K, R] -> [T, R, K, A]


def _segment_suffix_max(values: np.ndarray, segment: np.ndarray) -> np.ndarray:
    """For non-decreasing segment ids: max of ``values`` from each position to its segment's end (exact)."""
    if not len(values):
        return values
    uniq, code = np.unique(values, return_inverse=True)
    offset = (segment.max() - segment) * len(uniq)  # grows along the reversed walk
    key = (code.reshape(-1) + offset)[::-1]
    return uniq[(np.maximum.accumulate(key) - offset[::-1])[::-1]]


def _least_counts(num_gt: np.ndarray) -> np.ndarray:
    """[A, K, R]: the least integer c with float64 c / num_gt >= each recall threshold."""
    n = np.maximum(num_gt, 1).astype(np.float64)[..., None]
    guess = np.ceil(RECALL_THRESHOLDS * n)
    candidates = guess[..., None] + np.arange(-2, 3)  # [A, K, R, 5]
    ok = (candidates >= 0) & (candidates / n[..., None] >= RECALL_THRESHOLDS[:, None])
    return np.take_along_axis(candidates, ok.argmax(-1)[..., None], -1)[..., 0].astype(np.int64)


def summarize(precision: np.ndarray, recall: np.ndarray) -> np.ndarray:
    """The 12 numbers of ``COCOeval.summarize()`` for boxes (same selections, same means).

    Args:
        precision: [T, R, K, A] at 100 detections.
        recall: [T, K, A, M].
    """

    def mean(ap: bool, iou: float | None = None, area: int = 0, max_det: int = 2) -> float:
        s = precision[..., None] if ap else recall
        if iou is not None:
            s = s[np.where(iou == IOU_THRESHOLDS)[0]]
        s = s[:, :, :, [area], [0]] if ap else s[:, :, [area], [max_det]]
        return -1.0 if len(s[s > -1]) == 0 else float(np.mean(s[s > -1]))

    return np.array([
        mean(True), mean(True, 0.5), mean(True, 0.75), mean(True, area=1), mean(True, area=2), mean(True, area=3),
        mean(False, max_det=0), mean(False, max_det=1), mean(False), mean(False, area=1), mean(False, area=2),
        mean(False, area=3),
    ])


@dataclass
class CroppedMasks:
    """Instance masks, each kept as the crop of its pixels' bounding box (memory: the boxes' areas, not N
    whole images).

    Attributes:
        bounds: int64 [N, 4] ``(x1, y1, x2, y2)`` of each mask's pixels, x2 and y2 exclusive (0s when empty).
        crops: N bool arrays, [y2 - y1, x2 - x1] each.
        area: int64 [N] pixels in each mask.
    """

    bounds: np.ndarray
    crops: list[np.ndarray]
    area: np.ndarray

    @classmethod
    def from_masks(cls, masks: np.ndarray | list[np.ndarray]) -> CroppedMasks:
        """From whole-image masks ([N, H, W], or a list of [H, W]; nonzero is inside)."""
        bounds, crops = [], []
        for mask in masks:
            mask = np.asarray(mask) != 0
            rows, cols = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
            if not len(rows):
                bounds.append((0, 0, 0, 0))
                crops.append(np.zeros((0, 0), bool))
                continue
            x1, y1, x2, y2 = cols[0], rows[0], cols[-1] + 1, rows[-1] + 1
            bounds.append((x1, y1, x2, y2))
            crops.append(np.ascontiguousarray(mask[y1:y2, x1:x2]))
        area = np.array([int(c.sum()) for c in crops], np.int64)
        return cls(np.asarray(bounds, np.int64).reshape(-1, 4), crops, area)

    @classmethod
    def from_windows(cls, windows: np.ndarray, crops: Sequence[np.ndarray]) -> CroppedMasks:
        """From masks given inside windows of the image (``ops.masks.MaskCrops``: int [N, 4] ``(x1, y1, x2, y2)``
        and each window's mask): :meth:`from_masks` of the whole masks, without making them."""
        tight = cls.from_masks(crops)
        offsets = np.asarray(windows, np.int64).reshape(-1, 4)[:, [0, 1, 0, 1]]
        tight.bounds = np.where(tight.area[:, None] > 0, tight.bounds + offsets, 0)
        return tight

    def __len__(self) -> int:
        return len(self.crops)

    def dense(self, shape: tuple[int, int]) -> np.ndarray:
        """The masks as whole images: bool [N, H, W] of ``shape`` (H, W)."""
        out = np.zeros((len(self), int(shape[0]), int(shape[1])), bool)
        for whole, (x1, y1, x2, y2), crop in zip(out, self.bounds.tolist(), self.crops, strict=True):
            whole[y1:y2, x1:x2] = crop
        return out

    def pair_iou(self, other: CroppedMasks, mine: np.ndarray, theirs: np.ndarray) -> np.ndarray:
        """IoU of aligned pairs (``self[mine[p]]``, ``other[theirs[p]]``), as pycocotools' ``rleIou`` has it
        (no crowd): intersection over union of pixel counts in float64, 0 without intersection."""
        a, b = self.bounds[mine], other.bounds[theirs]
        lo, hi = np.maximum(a[:, :2], b[:, :2]), np.minimum(a[:, 2:], b[:, 2:])
        inter = np.zeros(len(mine), np.int64)
        for p in np.flatnonzero((hi > lo).all(1)):
            (x1, y1), (x2, y2) = lo[p], hi[p]
            ax, ay, bx, by = a[p, 0], a[p, 1], b[p, 0], b[p, 1]
            inter[p] = np.count_nonzero(self.crops[mine[p]][y1 - ay:y2 - ay, x1 - ax:x2 - ax]
                                        & other.crops[theirs[p]][y1 - by:y2 - by, x1 - bx:x2 - bx])
        union = self.area[mine] + other.area[theirs] - inter
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(inter > 0, inter / union.astype(np.float64), 0.0)


def evaluate_masks(gt_masks: CroppedMasks, gt_labels: np.ndarray, gt_images: np.ndarray, det_masks: CroppedMasks,
                   det_scores: np.ndarray, det_labels: np.ndarray, det_images: np.ndarray, num_classes: int, *,
                   gt_area: np.ndarray | None = None) -> BoxEval:
    """Scores instance masks the way ``COCOeval(..., "segm")`` does (no crowd ground truth).

    Args:
        gt_masks, det_masks: the masks, at each image's original resolution.
        gt_area: [G] each ground truth's area for the area ranges (a COCO json's ``area`` field, which for
            polygons is the polygon's area); None: its mask's pixel count. A detection's is its pixel count.
        gt_labels, gt_images, det_scores, det_labels, det_images, num_classes: as :func:`evaluate_boxes`.
    """
    return evaluate(gt_labels, gt_images, det_scores, det_labels, det_images, num_classes,
                    gt_area=gt_masks.area if gt_area is None else gt_area, det_area=det_masks.area,
                    pair_iou=lambda d, g: det_masks.pair_iou(gt_masks, d, g))
