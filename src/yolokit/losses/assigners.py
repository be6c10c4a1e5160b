"""Who trains what: YOLOv8's task-aligned assigner and YOLOv3's single-best-anchor matcher.

Everything here works on whole batches at once (no Python loop over images or boxes)
and without gradients: assignment is a decision about targets, not part of the loss.
Boxes are ``xyxy`` in input pixels.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from yolokit.losses.mask_overlap import MaskInputs, with_mask_iou
from yolokit.losses.pairwise import box_terms, pairwise_ciou


class RowAssignment(NamedTuple):
    """The assignment of N GT rows flat over the batch, seen from the GTs and from the points.

    Every point a GT trains is one of its k kept candidates, so the positives are also
    the ``positive`` entries of the fixed-size Tensor[N, k] form; except with the assigner's
    ``contested="any"``, where a point may go to a GT that did not keep it: the per-point
    fields are then the complete ones.

    Attributes:
        points: Tensor[N, k] int64, each GT's k best points by alignment (index into P);
            an entry is meaningful where ``positive``.
        positive: Tensor[N, k] bool, True where the point trains this GT: inside it, among
            its top k, and not taken by a GT of the same image with a higher overlap.
        weights: Tensor[N, k] float32 normalized alignment where ``positive``, 0 elsewhere.
        point_row: Tensor[B, P] int64 row of the GT each point trains, N at background.
        point_weights: Tensor[B, P] float32 the point's weight, 0 at background.
    """

    points: Tensor
    positive: Tensor
    weights: Tensor
    point_row: Tensor
    point_weights: Tensor


BYTES_PER_PAIR = 100   # what one (GT, point) pair of a chunk holds, about (t, u, CIoU terms, masks)


def _constant_to_compile(fn):
    """``torch.compiler.assume_constant_result`` without importing ``torch._dynamo`` at import time (a
    second of every process's start): the mark that decorator puts on the function, and nothing else
    (tests/accel/test_compile.py checks that they agree)."""
    fn._dynamo_marked_constant = True
    return fn


def chunk_pairs_for(device: torch.device, free_bytes: int | None = None) -> int:
    """(GT, point) pairs the task-aligned assigner evaluates at once on ``device``.

    CPU: 2^18. CUDA: a sixteenth of the free memory (``free_bytes``, read from the device when
    None) at ``BYTES_PER_PAIR``, between 2^18 and 2^25 pairs (3.4 GB): on a GPU each chunk is
    some 180 kernel launches, so few large chunks keep the assigner from being launch-bound.
    """
    if device.type != "cuda":
        return 2**18
    if free_bytes is None:
        free_bytes = torch.cuda.mem_get_info(device)[0]
    return int(min(max(free_bytes // 16 // BYTES_PER_PAIR, 2**18), 2**25))


def widening_side(strides) -> float:
    """The shortest GT side of Ultralytics 8.4's "inside" test for a head of these strides: the
    second level's stride (the only one's for a single level), 16 px for strides 8, 16, 32."""
    strides = [float(s) for s in strides]
    return strides[1] if len(strides) > 1 else strides[0]


def widened(boxes: Tensor, min_side: float) -> Tensor:
    """``xyxy`` boxes with each side shorter than ``min_side`` widened to it about the centre.

    Every box goes through centre and size and back (as Ultralytics computes it), so a side left as
    it is may still move by a rounding step.
    """
    centre = (boxes[:, :2] + boxes[:, 2:]) / 2
    size = boxes[:, 2:] - boxes[:, :2]
    half = torch.where(size < min_side, min_side, size) / 2
    return torch.cat([centre - half, centre + half], 1)


class TaskAlignedAssigner(nn.Module):
    """YOLOv8's task-aligned assigner (TOOD, Feng et al. 2021), without host reads.

    For each GT box g and point p whose centre lies strictly inside g:
    ``t = s^alpha * u^beta`` with s the predicted score of g's class at p and u the CIoU
    (clamped at 0) of p's predicted box with g. Each GT keeps its ``topk`` candidates
    by t; a point kept by several GTs goes to the one with the highest u (ties to the
    lower GT index). The target score of a positive point on its GT's class is
    ``t * max(u over the GT's positives) / (max(t over the GT's positives) + eps)``.

    Unlike Ultralytics, top-k ranks only the points inside the GT (so a GT with fewer
    than ``topk`` points inside keeps them all) and a contested point goes to the best
    of the GTs that kept it, never to a GT that did not.

    Three options give Ultralytics 8.4's assigner (which YOLO26 trains with); all off by default:

    - ``topk2``: after the contested points are settled, each GT keeps only its ``topk2``
      positives of highest t (YOLO26's one-to-one branch: ``topk=7, topk2=1``, one point
      per GT); the others become background, not another GT's.
    - ``min_gt_side``: for the "inside" test only, a GT side shorter than this (pixels) is
      widened to it about the box's centre, so that a small GT still holds points of the
      finer levels (Ultralytics widens to its second level's stride, 16 px for strides
      8, 16, 32: :func:`widening_side`). The box itself (its CIoU, its targets) is unchanged.
    - ``contested="any"``: a point that several GTs kept goes to the GT of highest u among
      *all* the GTs that hold it (ties to the lower row), even one that did not keep it, whose
      positives it then joins (its normalization included). A candidate of t = 0 is not kept
      (see below). The per-point form of the result (``point_row``, ``point_weights``) is then
      the complete one: such a point is not among its GT's ``[N, k]`` entries.

    What still differs from Ultralytics, with every option on: its top-k ranks the points
    outside a GT as t = 0, tied with the inside points of t = 0 (u = 0: a predicted box that
    does not overlap the GT), and breaks that tie in an unspecified, device-dependent order, so
    a GT with fewer than ``topk`` points of t > 0 may keep some of those inside points as
    positives of weight 0. Such a point trains nothing itself, but it counts as a claim when
    another GT kept it too, and the point then goes to the GT of highest u. With
    ``contested="any"`` a candidate of t = 0 never counts (the likelier outcome there: the
    tie is mostly filled with the far more numerous outside points), so the two agree whenever
    Ultralytics' tie order picked no such point; its foreground is then this one's plus those
    weight-0 points.

    Memory and reads: t and u are computed for every (GT, point) pair, ``chunk_pairs``
    pairs at a time, and only each GT's top k survive a chunk, so the extra memory is
    about 100 bytes per pair of one chunk plus O(N * k + B * P), whatever the number of
    boxes; every shape follows from the input shapes, so nothing is read back from the
    device (no ``nonzero``, no ``.item()``).

    Args:
        topk: candidates kept per GT.
        alpha: exponent of the classification score in the alignment metric.
        beta: exponent of the IoU in the alignment metric.
        eps: strictness of "inside" (pixels) and guard of the normalizing division.
        chunk_pairs: (GT, point) pairs evaluated at once (at least one GT's row of P); results
            do not depend on it. None: sized for the device (:func:`chunk_pairs_for`): 2^18
            (about 26 MB, fastest on a 2-core CPU) on the CPU; on CUDA a sixteenth of the free
            memory, up to 2^25 pairs, so that a 64-image batch of 100 boxes at 640 px (54M
            pairs) is 2 chunks of some 180 operations each, not 200.
        topk2: positives each GT keeps at most, by t, after contested points are settled;
            None (or ``topk2 >= topk``): all of them.
        min_gt_side: the shortest GT side (pixels) of the "inside" test; 0: the box as it is.
        contested: who gets a point several GTs kept: ``"kept"``, the one of highest u among
            them; ``"any"``, the one of highest u among all the GTs that hold it (Ultralytics).
    """

    def __init__(self, topk: int = 10, alpha: float = 0.5, beta: float = 6.0, eps: float = 1e-9,
                 chunk_pairs: int | None = None, *, topk2: int | None = None, min_gt_side: float = 0.0,
                 contested: str = "kept"):
        super().__init__()
        if contested not in ("kept", "any"):
            raise ValueError(f"contested must be 'kept' or 'any', got {contested!r}")
        if topk2 is not None and topk2 < 1:
            raise ValueError(f"topk2 must be >= 1 (or None), got {topk2}")
        if min_gt_side < 0:
            raise ValueError(f"min_gt_side must be >= 0, got {min_gt_side}")
        self.topk, self.alpha, self.beta, self.eps, self.chunk_pairs = topk, alpha, beta, eps, chunk_pairs
        self.topk2, self.min_gt_side, self.contested = topk2, float(min_gt_side), contested
        self._sized: dict[torch.device, int] = {}   # chunk_pairs=None: the size found per device, once

    def extra_repr(self) -> str:
        extra = "" if self.topk2 is None else f", topk2={self.topk2}"
        extra += f", min_gt_side={self.min_gt_side:g}" if self.min_gt_side else ""
        extra += f", contested={self.contested!r}" if self.contested != "kept" else ""
        return f"topk={self.topk}, alpha={self.alpha}, beta={self.beta}, chunk_pairs={self.chunk_pairs}{extra}"

    @_constant_to_compile
    def pairs_per_chunk(self, device: torch.device) -> int:
        """``chunk_pairs``, or the device's size (read once per device: CUDA's free memory). A constant to
        ``torch.compile``: read when the loss is traced, not guarded (a guard on the cache would compile the
        loss a second time, once the first call has filled it)."""
        if self.chunk_pairs is not None:
            return self.chunk_pairs
        if device not in self._sized:
            self._sized[device] = chunk_pairs_for(device)
        return self._sized[device]

    @torch.no_grad()
    def assign_rows(
        self,
        pred_scores: Tensor,
        pred_boxes: Tensor,
        points: Tensor,
        image: Tensor,
        labels: Tensor,
        boxes: Tensor,
        valid: Tensor | None = None,
        *,
        per_image: int | None = None,
        logits: bool = False,
        masks: MaskInputs | None = None,
    ) -> RowAssignment:
        """The assignment of GT rows flat over the batch (``targets`` as they come, or padded).

        Args:
            pred_scores: Tensor[B, P, C] class probabilities, or class logits with
                ``logits=True`` (any strides: only the scores of each GT's class are read,
                and with logits only they go through the sigmoid).
            pred_boxes: Tensor[B, P, 4] decoded predicted boxes, xyxy pixels.
            points: Tensor[P, 2] (x, y) of each point in pixels.
            image: Tensor[N] int64 image of each GT, in [0, B) (not checked: that would
                read the device).
            labels: Tensor[N] int64 classes.
            boxes: Tensor[N, 4] xyxy pixels.
            valid: Tensor[N] bool, False for rows never to assign (padding); None: all valid.
            per_image: G when the rows are padded per image, image-major (row = image * G +
                slot, as ``pad_targets(...).rows()`` lays them out; ``image`` must match): the
                predictions are then read in place instead of copied per GT, which is faster.
            logits: ``pred_scores`` holds logits.
            masks: predicted and GT masks (YOLO26-seg): each GT's ``3 * topk`` inside points of highest
                box-only t get the IoU of their predicted mask (``coefficients @ protos > 0``, cropped to the
                predicted box) with the GT's mask, and every inside pair's u becomes ``(CIoU + mask IoU) / 2``
                (the mask IoU 0 for the others) before t, the top k, the contests and the weights.

        Returns:
            ``RowAssignment``; ties between GTs of one image go to the earlier row.
        """
        b, p, _ = pred_scores.shape
        n, k, device = image.shape[0], min(self.topk, p), pred_scores.device
        valid = torch.ones(n, dtype=torch.bool, device=device) if valid is None else valid.bool()
        image, labels = image.long(), labels.long()
        best_gt = None
        if self.contested == "any":   # per point: the highest u over every GT holding it, its row and t
            best_gt = [torch.full((b * p,), -1.0, device=device),
                       torch.full((b * p,), n, dtype=torch.long, device=device), torch.zeros(b * p, device=device)]
        top, align, overlap, kept = self._top_candidates(pred_scores, pred_boxes.float(), points.float(), image,
                                                         labels, boxes.float(), valid, k, per_image, logits, best_gt,
                                                         masks)
        key = (image[:, None] * p + top).view(-1)  # flat (image, point) of every entry
        if best_gt is not None:
            return self._settle_any(top, align, overlap, kept, key, best_gt, b, p)
        # One GT per point: among the GTs that kept it, the highest overlap, then the lowest row.
        overlap_kept = overlap.masked_fill(~kept, -1.0).view(-1)
        best = overlap.new_full((b * p,), -1.0).scatter_reduce_(0, key, overlap_kept, "amax")
        row = torch.arange(n, device=device)[:, None].expand(n, k).reshape(-1)
        contender = torch.where(kept.view(-1) & (overlap_kept == best[key]), row, n)
        point_row = torch.full((b * p,), n, dtype=torch.long, device=device).scatter_reduce_(0, key, contender, "amin")
        positive = (point_row[key] == row).view(n, k)
        if self.topk2 is not None and self.topk2 < k:  # each GT keeps its topk2 best positives; the rest: background
            best_t = align.masked_fill(~positive, -1.0).topk(self.topk2, dim=-1).indices
            positive &= torch.zeros_like(positive).scatter_(1, best_t, True)
            contender = torch.where(positive.view(-1), row, n)
            point_row = torch.full((b * p,), n, dtype=torch.long, device=device).scatter_reduce_(
                0, key, contender, "amin")

        align = align.masked_fill_(~positive, 0.0)
        max_overlap = overlap.masked_fill_(~positive, 0.0).amax(-1)  # [N] over each GT's positives
        weights = align * (max_overlap / (align.amax(-1) + self.eps))[:, None]
        point_weights = weights.new_zeros(b * p).scatter_reduce_(0, key, weights.view(-1), "amax")
        return RowAssignment(top, positive, weights, point_row.view(b, p), point_weights.view(b, p))

    def _settle_any(self, top: Tensor, align: Tensor, overlap: Tensor, kept: Tensor, key: Tensor,
                    best: list[Tensor], b: int, p: int) -> RowAssignment:
        """``contested="any"``: the assignment from each GT's candidates and each point's best GT,
        worked out per point (a point may go to a GT that did not keep it)."""
        n, k = top.shape
        device = top.device
        kept = (kept & (align > 0)).view(-1)   # a candidate of t = 0 (u = 0) claims nothing
        row = torch.arange(n, device=device)[:, None].expand(n, k).reshape(-1)
        keepers = torch.zeros(b * p, dtype=torch.long, device=device).scatter_add_(0, key, kept.long())
        # a point kept once is its keeper's, with the keeper's t and u (the only entry not masked)
        keeper_row = torch.full((b * p,), n, dtype=torch.long, device=device).scatter_reduce_(
            0, key, torch.where(kept, row, n), "amin")
        keeper_t = align.new_full((b * p,), -1.0).scatter_reduce_(0, key, align.view(-1).masked_fill(~kept, -1.0),
                                                                  "amax")
        keeper_u = overlap.new_full((b * p,), -1.0).scatter_reduce_(0, key, overlap.view(-1).masked_fill(~kept, -1.0),
                                                                    "amax")
        best_u, best_row, best_t = best
        contested = keepers > 1
        point_row = torch.where(contested, best_row, torch.where(keepers == 1, keeper_row, n))
        t, u = torch.where(contested, best_t, keeper_t), torch.where(contested, best_u, keeper_u)
        if self.topk2 is not None and self.topk2 < k:  # each GT keeps its topk2 best positives; the rest: background
            point_row = torch.where(_rank_in_group(point_row, t, n + 1) < self.topk2, point_row, n)
        foreground = point_row < n
        t, u = t.masked_fill(~foreground, 0.0), u.masked_fill(~foreground, 0.0)
        max_t = t.new_zeros(n + 1).scatter_reduce_(0, point_row, t, "amax")  # over each GT's positives
        max_u = u.new_zeros(n + 1).scatter_reduce_(0, point_row, u, "amax")
        point_weights = t * max_u[point_row] / (max_t[point_row] + self.eps)
        positive = kept & (point_row[key] == row)   # the entries of the [N, k] form that train their GT
        weights = torch.where(positive, point_weights[key], 0.0).view(n, k)
        return RowAssignment(top, positive.view(n, k), weights, point_row.view(b, p), point_weights.view(b, p))

    def _top_candidates(self, pred_scores: Tensor, pred_boxes: Tensor, points: Tensor, image: Tensor,
                        labels: Tensor, gt_boxes: Tensor, valid: Tensor, k: int, per_image: int | None,
                        logits: bool, best: list[Tensor] | None = None,
                        masks: MaskInputs | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Each GT's k best points by t, computed chunk by chunk of rows.

        With ``best`` (Tensor[B * P] highest u, its row, its t; -1, N, 0 at first), each point's
        best GT among every GT of its image is also kept up to date: u and t are 0 where the point
        is outside (or the row invalid), the lowest row wins a tie.

        Returns:
            ``(points, t, u, inside)``, each Tensor[N, k]: point indices (int64), alignment
            metric (-1 off the candidates), clamped CIoU, and whether the point is inside the GT.
        """
        (b, p, c), n = pred_scores.shape, image.shape[0]
        scores = pred_scores.transpose(1, 2)  # [B, C, P] view
        flat_scores = scores.reshape(b * c, p) if scores.stride(-1) == 1 and scores.stride(0) == c * p else None
        pred_terms = torch.stack(box_terms(pred_boxes), dim=1)  # [B, 6, P]
        # per GT: its terms, then "inside" bounds x1 + eps, y1 + eps, x2 - eps, y2 - eps (none for invalid rows)
        inside = widened(gt_boxes, self.min_gt_side) if self.min_gt_side > 0 else gt_boxes
        low = torch.where(valid[:, None], inside[:, :2] + self.eps, torch.inf)
        gt_terms = torch.cat([torch.stack(box_terms(gt_boxes), dim=1), low, inside[:, 2:] - self.eps], 1)
        out = (torch.empty(n, k, dtype=torch.long, device=points.device), pred_boxes.new_empty(n, k),
               pred_boxes.new_empty(n, k), torch.empty(n, k, dtype=torch.bool, device=points.device))
        x, y = points[:, 0], points[:, 1]
        for rows, pred, shape in self._chunks(pred_terms, image, per_image):
            gt = gt_terms[rows].view(*shape, 10)[..., None].unbind(-2)  # each [b_c, g_c, 1]
            # x > x1 <=> x - x1 > 0 for floats (gradual underflow); subtractions are cheaper than compares
            margin = torch.minimum(x - gt[6], gt[8] - x)
            outside = torch.minimum(margin, torch.minimum(y - gt[7], gt[9] - y), out=margin) <= 0  # [b_c, g_c, P]
            u = pairwise_ciou(pred.unbind(1), gt[:6]).clamp_(min=0)
            if flat_scores is not None:  # [r, P] score of each GT's class
                s = flat_scores.index_select(0, image[rows] * c + labels[rows]).float()
            else:
                s = scores[image[rows], labels[rows]].float()
            if logits:
                s = s.sigmoid_()
            if masks is not None:   # u: the mean of the CIoU and the mask IoU (0 off each GT's 3k best pairs)
                u = with_mask_iou(u, s, outside, masks, pred_boxes, image[rows], rows, self.topk, self.alpha,
                                  self.beta, self.eps)
            t = s.pow_(self.alpha).mul_(u.pow(self.beta).view(-1, p)).masked_fill_(outside.view(-1, p), -1.0)
            t_top, top = t.topk(k, dim=-1)
            chosen = (top, t_top, u.view(-1, p).gather(1, top), ~outside.view(-1, p).gather(1, top))
            for buf, value in zip(out, chosen, strict=True):
                buf[rows] = value
            if best is not None:
                _update_best(best, u.masked_fill_(outside, 0.0), t.view(*shape, p).clamp_(min=0.0), rows,
                             image[rows].view(shape)[:, 0], image.shape[0])
        return out

    def _chunks(self, pred_terms: Tensor, image: Tensor, per_image: int | None):
        """Yields ``(rows, pred, (b_c, g_c))``: a slice of at most ``chunk_pairs / P`` GT rows
        (more if whole padded images fit), seen as b_c images of g_c GTs, and the predicted
        terms Tensor[b_c, 6, 1, P] of those images: slices of ``pred_terms`` Tensor[B, 6, P]
        for padded rows, a copy per row (b_c = r, g_c = 1) otherwise."""
        n, p = image.shape[0], pred_terms.shape[-1]
        if n == 0:                       # no GT in the batch (max_boxes=0): nothing to rank
            return
        rows_per_chunk = max(1, self.pairs_per_chunk(pred_terms.device) // max(p, 1))
        if per_image is None:
            for start in range(0, n, rows_per_chunk):
                rows = slice(start, min(start + rows_per_chunk, n))
                yield rows, pred_terms.index_select(0, image[rows])[:, :, None], (rows.stop - start, 1)
        elif per_image <= rows_per_chunk:  # whole images at a time
            g = per_image              # step at most the batch: a compiled loss is traced again when the
            step = min(rows_per_chunk // g, n // g)   # chunk count changes, not for every max_boxes
            for b0 in range(0, n // g, step):
                b1 = min(b0 + step, n // g)
                yield slice(b0 * g, b1 * g), pred_terms[b0:b1, :, None], (b1 - b0, g)
        else:  # parts of one image at a time
            g = per_image
            for b in range(n // g):
                for g0 in range(0, g, rows_per_chunk):
                    g1 = min(g0 + rows_per_chunk, g)
                    yield slice(b * g + g0, b * g + g1), pred_terms[b:b + 1, :, None], (1, g1 - g0)


def _update_best(best: list[Tensor], u: Tensor, t: Tensor, rows: slice, images: Tensor, n: int) -> None:
    """Folds a chunk's GTs into each point's best GT so far (``best``: Tensor[B * P] highest u,
    its row, its t). ``u`` and ``t``: Tensor[b_c, g_c, P], 0 where the point is outside; the chunk's
    rows are ``rows``, image-major (b_c images, their first row's image in ``images``). The lowest
    row wins a tie, within the chunk and against earlier (lower) rows."""
    (b_c, g_c, p), device = u.shape, u.device
    chunk_u, index = u.max(dim=1)  # [b_c, P], the first GT of the highest u
    chunk_t = t.gather(1, index[:, None]).squeeze(1)
    chunk_row = rows.start + torch.arange(b_c, device=device)[:, None] * g_c + index
    # rows of one image may span several of the chunk's b_c (rows as they come): fold them per point
    key = (images[:, None] * p + torch.arange(p, device=device)).view(-1)
    chunk_u, chunk_t, chunk_row = chunk_u.view(-1), chunk_t.view(-1), chunk_row.view(-1)
    top_u = torch.full_like(best[0], -1.0).scatter_reduce_(0, key, chunk_u, "amax")
    top_row = torch.full_like(best[1], n).scatter_reduce_(0, key, torch.where(chunk_u == top_u[key], chunk_row, n),
                                                          "amin")
    at_top = torch.where(chunk_row == top_row[key], chunk_t, -1.0)
    top_t = torch.full_like(best[2], -1.0).scatter_reduce_(0, key, at_top, "amax")
    better = top_u > best[0]
    for buf, value in zip(best, (top_u, top_row, top_t), strict=True):
        buf.copy_(torch.where(better, value, buf))


def _rank_in_group(group: Tensor, value: Tensor, groups: int) -> Tensor:
    """Rank of each element by ``value`` (highest first; ties: the lower index) among the elements
    of its ``group`` (Tensor[M] int64 in [0, groups)), with fixed shapes (two stable sorts)."""
    m = group.shape[0]
    order = torch.sort(value, descending=True, stable=True).indices
    order = order[torch.sort(group[order], stable=True).indices]  # grouped, by value within a group
    sizes = torch.zeros(groups, dtype=torch.long, device=group.device).scatter_add_(0, group, torch.ones_like(group))
    first = sizes.cumsum(0) - sizes
    ranks = torch.arange(m, device=group.device) - first[group[order]]
    return torch.empty_like(group).scatter_(0, order, ranks)
