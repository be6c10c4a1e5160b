"""Tests of losses/assigners.py: padding, the task-aligned assigner, the anchor matcher."""

from __future__ import annotations

import math

import pytest
import torch
from _dense_assignment import dense_assignment, point_targets  # tests/ is on sys.path (tests/conftest.py)

from yolokit.losses import AnchorMatcher, TaskAlignedAssigner, pad_targets
from yolokit.losses.anchor_matcher import wh_iou
from yolokit.ops.anchors import grid_points
from yolokit.ops.boxes import ciou

TINY_ANCHORS = (((23, 27), (37, 58), (81, 82)), ((81, 82), (135, 169), (344, 319)))


def _grid4() -> torch.Tensor:
    """Points of one 4x4 level at stride 8: x, y in {4, 12, 20, 28}; index = 4 * row + col."""
    return grid_points([(4, 4)], [8])[0]


def _assign(scores, boxes, gt_boxes, gt_labels, topk=10, num_classes=2, fill=0.0):
    points = _grid4()
    pred_scores = torch.full((1, len(points), num_classes), fill)
    for p, (c, s) in scores.items():
        pred_scores[0, p, c] = s
    pred_boxes = torch.tensor([[[x - 4.0, y - 4.0, x + 4.0, y + 4.0] for x, y in points.tolist()]])
    for p, box in boxes.items():
        pred_boxes[0, p] = torch.tensor(box)
    gt = torch.tensor([gt_boxes], dtype=torch.float32)
    labels = torch.tensor([gt_labels])
    return dense_assignment(TaskAlignedAssigner(topk=topk), pred_scores, pred_boxes, points, labels, gt,
                            torch.ones_like(labels).bool())


# ----------------------------------------------------------------------------- pad_targets


def test_pad_targets_places_boxes_per_image_in_order():
    t = torch.tensor([[2, 1, 0, 0, 4, 4], [0, 3, 1, 1, 2, 2], [2, 0, 5, 5, 9, 9], [2, 2, 6, 6, 7, 7.0]])
    p = pad_targets(t, 4)
    assert p.boxes.shape == (4, 3, 4) and p.labels.dtype == torch.long
    assert p.mask.tolist() == [[True, False, False], [False] * 3, [True, True, True], [False] * 3]
    assert p.labels[2].tolist() == [1, 0, 2] and p.labels[0, 0] == 3
    assert p.boxes[2, 1].tolist() == [5, 5, 9, 9]
    assert p.boxes[1].abs().sum() == 0


def test_pad_targets_empty_and_out_of_range():
    p = pad_targets(torch.zeros(0, 6), 3)
    assert p.boxes.shape == (3, 0, 4) and p.mask.shape == (3, 0)
    with pytest.raises(ValueError, match="image index 3"):
        pad_targets(torch.tensor([[3, 0, 0, 0, 1, 1.0]]), 3)


# ----------------------------------------------------------------------------- task-aligned


def test_tal_one_gt_known_assignment():
    """GT (0,0,16,16) holds points 0, 1, 4, 5. With topk=2 the two best t win, and target
    scores are t * max_u / max_t on the GT's class."""
    u0 = 144 / 256  # concentric (2,2,14,14) in (0,0,16,16): CIoU = IoU
    out = _assign(
        scores={0: (1, 0.81), 1: (1, 0.36), 4: (1, 0.25), 5: (1, 0.04), 2: (1, 0.99), 15: (1, 0.99)},
        boxes={0: [2, 2, 14, 14], 1: [0, 0, 16, 16], 4: [0, 0, 16, 16], 5: [0, 0, 16, 16]},
        gt_boxes=[[0, 0, 16, 16]], gt_labels=[1], topk=2,
    )
    t0, t1, t4 = 0.9 * u0**6, 0.6, 0.5  # s^0.5 * u^6
    assert t4 < t1 and t0 < t4  # so the top two are points 1 and 4
    assert out.foreground[0].nonzero().flatten().tolist() == [1, 4]
    expected = torch.zeros(16, 2)
    expected[1, 1] = t1 * 1.0 / t1
    expected[4, 1] = t4 * 1.0 / t1
    torch.testing.assert_close(out.scores[0], expected, atol=1e-5, rtol=1e-5)
    assert out.boxes[0, 1].tolist() == [0, 0, 16, 16] and out.boxes[0, 4].tolist() == [0, 0, 16, 16]


def test_tal_target_scores_scaled_by_best_overlap():
    """Both candidates kept; the best overlap among the positives is u0 < 1."""
    u0, u1 = 144 / 256, 64 / 256  # (2,2,14,14) and (4,4,12,12) inside (0,0,16,16)
    out = _assign(scores={0: (0, 0.81), 5: (0, 0.36)}, boxes={0: [2, 2, 14, 14], 5: [4, 4, 12, 12]},
                  gt_boxes=[[0, 0, 16, 16]], gt_labels=[0], topk=10)
    t0, t5 = 0.9 * u0**6, 0.6 * u1**6
    assert set(out.foreground[0].nonzero().flatten().tolist()) <= {0, 1, 4, 5}
    assert out.scores[0, 0, 0].item() == pytest.approx(t0 * u0 / t0, rel=1e-5)
    assert out.scores[0, 5, 0].item() == pytest.approx(t5 * u0 / t0, rel=1e-5)
    assert out.scores[0, :, 1].abs().sum() == 0


def test_tal_two_gts_compete_for_a_point():
    """Point 5 (12, 12) lies in GT A (0,0,16,16) and GT B (0,0,24,24); it goes to the GT
    its predicted box overlaps more."""
    a, b = [0.0, 0.0, 16.0, 16.0], [0.0, 0.0, 24.0, 24.0]
    for pred_at_5, winner in ((a, 0), (b, 1)):
        out = _assign(scores={}, boxes={5: pred_at_5}, gt_boxes=[a, b], gt_labels=[0, 1], topk=10, fill=0.5)
        assert out.foreground[0, 5] and out.gt_index[0, 5] == winner
        assert out.scores[0, 5, winner] > 0 and out.scores[0, 5, 1 - winner] == 0
        assert out.boxes[0, 5].tolist() == (a if winner == 0 else b)
        # points only B holds go to B
        for p in (2, 6, 8, 9, 10):
            if out.foreground[0, p]:
                assert out.gt_index[0, p] == 1


def _reference_tal(scores, boxes, points, labels, gts, mask, topk, alpha=0.5, beta=6.0, eps=1e-9):
    """The spec, written with loops (slow, obvious)."""
    b_, p_, c_ = scores.shape
    fg = torch.zeros(b_, p_, dtype=torch.bool)
    gt_index = torch.zeros(b_, p_, dtype=torch.long)
    target = torch.zeros(b_, p_, c_)
    for b in range(b_):
        claims = {}  # point -> list of (u, g)
        t, u = {}, {}
        for g in range(gts.shape[1]):
            if not mask[b, g]:
                continue
            x1, y1, x2, y2 = gts[b, g].tolist()
            cand = [p for p in range(p_) if x1 < points[p, 0] < x2 and y1 < points[p, 1] < y2]
            for p in cand:
                u[g, p] = max(ciou(boxes[b, p], gts[b, g]).item(), 0.0)
                t[g, p] = scores[b, p, labels[b, g]].item() ** alpha * u[g, p] ** beta
            for p in sorted(cand, key=lambda p: -t[g, p])[:topk]:
                claims.setdefault(p, []).append((u[g, p], -g))
        owner = {p: -max(c)[1] for p, c in claims.items()}
        for g in range(gts.shape[1]):
            mine = [p for p, o in owner.items() if o == g]
            if not mine:
                continue
            max_t, max_u = max(t[g, p] for p in mine), max(u[g, p] for p in mine)
            for p in mine:
                fg[b, p], gt_index[b, p] = True, g
                target[b, p, labels[b, g]] = t[g, p] * max_u / (max_t + eps)
    return fg, gt_index, target


def test_tal_matches_loop_reference_on_random_batches():
    gen = torch.Generator().manual_seed(0)
    points, _ = grid_points([(8, 8), (4, 4)], [8, 16])
    b, p, c, g = 3, len(points), 3, 4
    centres = points[None] + torch.randn(b, p, 2, generator=gen) * 3
    wh = 8 + torch.rand(b, p, 2, generator=gen) * 24
    boxes = torch.cat([centres - wh / 2, centres + wh / 2], -1)
    scores = torch.rand(b, p, c, generator=gen)
    xy = torch.rand(b, g, 2, generator=gen) * 40
    gts = torch.cat([xy, xy + 10 + torch.rand(b, g, 2, generator=gen) * 30], -1)
    labels = torch.randint(0, c, (b, g), generator=gen)
    mask = torch.tensor([[True, True, True, False], [True, False, False, False], [True] * 4])
    out = dense_assignment(TaskAlignedAssigner(topk=5), scores, boxes, points, labels, gts, mask)
    fg, gt_index, target = _reference_tal(scores, boxes, points, labels, gts, mask, topk=5)
    assert fg.sum() > 10
    assert torch.equal(out.foreground, fg)
    assert torch.equal(out.gt_index[fg], gt_index[fg])
    torch.testing.assert_close(out.scores, target, atol=1e-6, rtol=1e-5)


def test_tal_is_invariant_to_gt_order():
    gen = torch.Generator().manual_seed(1)
    points, _ = grid_points([(8, 8)], [8])
    centres = points[None].repeat(2, 1, 1)
    boxes = torch.cat([centres - 10, centres + 10], -1) + torch.randn(2, 64, 4, generator=gen)
    scores = torch.rand(2, 64, 2, generator=gen)
    gts = torch.tensor([[[0, 0, 30, 30], [10, 10, 50, 40], [20, 5, 60, 60.0]]] * 2)
    labels = torch.tensor([[0, 1, 1]] * 2)
    mask = torch.ones(2, 3, dtype=torch.bool)
    tal = TaskAlignedAssigner()
    a = dense_assignment(tal, scores, boxes, points, labels, gts, mask)
    perm = torch.tensor([2, 0, 1])
    bb = dense_assignment(tal, scores, boxes, points, labels[:, perm], gts[:, perm], mask)
    assert torch.equal(a.foreground, bb.foreground)
    torch.testing.assert_close(a.scores, bb.scores)
    torch.testing.assert_close(a.boxes[a.foreground], bb.boxes[bb.foreground])
    assert torch.equal(perm[bb.gt_index[bb.foreground]], a.gt_index[a.foreground])


def test_tal_padding_and_no_gt():
    points = _grid4()
    tal = TaskAlignedAssigner()
    scores, boxes = torch.rand(2, 16, 2), torch.rand(2, 16, 4) * 8
    boxes[..., 2:] += 8
    none = torch.zeros(2, 0).long(), torch.zeros(2, 0, 4), torch.zeros(2, 0).bool()
    out = dense_assignment(tal, scores, boxes, points, *none)
    assert out.scores.shape == (2, 16, 2) and not out.foreground.any() and out.scores.sum() == 0
    # a padding row covering everything must not be assigned
    gts = torch.tensor([[[0, 0, 32, 32.0]], [[0, 0, 32, 32.0]]])
    out = dense_assignment(tal, scores, boxes, points, torch.zeros(2, 1).long(), gts, torch.tensor([[False], [True]]))
    assert not out.foreground[0].any() and out.foreground[1].any()


# ----------------------------------------------------------------------------- anchor matcher


def test_wh_iou_values():
    iou = wh_iou(torch.tensor([[10.0, 20.0]]), torch.tensor([[10.0, 20.0], [20.0, 10.0], [5.0, 10.0]]))
    torch.testing.assert_close(iou, torch.tensor([[1.0, 100 / 300, 50 / 200]]))


def test_anchor_matcher_picks_single_best_anchor_over_levels():
    matcher = AnchorMatcher(TINY_ANCHORS, (16, 32))
    targets = torch.tensor([
        [0, 0, 100, 100, 181, 182],  # exactly (81, 82): first occurrence, level 0 anchor 2
        [1, 1, 10, 20, 354, 339],  # (344, 319): level 1 anchor 2
        [0, 2, 40, 50, 63, 77],  # (23, 27): level 0 anchor 0
        [1, 0, 0, 0, 0.5, 0.5],  # tiny: best is the smallest anchor
    ])
    m = matcher(targets, [(16, 16), (8, 8)])
    assert m.flat_anchor.tolist() == [2, 5, 0, 0]
    assert m.level.tolist() == [0, 1, 0, 0] and m.anchor.tolist() == [2, 2, 0, 0]
    assert m.cell_x.tolist() == [math.floor(140.5 / 16), math.floor(182 / 32), math.floor(51.5 / 16), 0]
    assert m.cell_y.tolist() == [math.floor(141 / 16), math.floor(179.5 / 32), math.floor(63.5 / 16), 0]
    assert m.image.tolist() == [0, 1, 0, 1]


def test_anchor_matcher_clamps_border_centres():
    matcher = AnchorMatcher(TINY_ANCHORS, (16, 32))
    # centre exactly on the right/bottom border (256) and left of the image
    targets = torch.tensor([[0, 0, 236, 236, 276, 276], [0, 0, -30, -30, 10, 10.0]])
    m = matcher(targets, [(16, 16), (8, 8)])
    assert m.cell_x.tolist() == [15, 0] and m.cell_y.tolist() == [15, 0]


def test_point_targets_is_the_sparse_form_of_the_dense_assignment():
    gen = torch.Generator().manual_seed(7)
    b, p, c, g = 3, 64, 4, 5
    points = torch.stack(torch.meshgrid(torch.arange(8.0), torch.arange(8.0), indexing="xy"), -1).reshape(-1, 2) * 4 + 2
    logits = torch.randn(b, p, c, generator=gen) * 2
    xy = torch.rand(b, p, 2, generator=gen) * 24
    boxes = torch.cat([xy, xy + 4 + torch.rand(b, p, 2, generator=gen) * 8], -1)
    gxy = torch.rand(b, g, 2, generator=gen) * 20
    gts = torch.cat([gxy, gxy + 6 + torch.rand(b, g, 2, generator=gen) * 10], -1)
    labels = torch.randint(0, c, (b, g), generator=gen)
    mask = torch.rand(b, g, generator=gen) > 0.3
    tal = TaskAlignedAssigner(topk=4)
    dense = dense_assignment(tal, logits.sigmoid(), boxes, points, labels, gts, mask)
    for sparse in (point_targets(tal, logits.sigmoid(), boxes, points, labels, gts, mask),
                   point_targets(tal, logits.transpose(1, 2).contiguous().transpose(1, 2), boxes, points, labels, gts,
                                     mask, logits=True)):
        assert dense.foreground.any()
        assert torch.equal(sparse.foreground, dense.foreground) and torch.equal(sparse.gt_index, dense.gt_index)
        torch.testing.assert_close(sparse.boxes, dense.boxes)
        torch.testing.assert_close(sparse.weights, dense.scores.sum(-1))
        fg = sparse.foreground
        assert torch.equal(sparse.labels[fg], labels.gather(1, sparse.gt_index)[fg])
        assert (sparse.weights[~fg] == 0).all()


# ----------------------------------------------------------------------------- chunks and host reads


def _dense_case(b=3, g=9, size=128, seed=11, empty_image=1):
    """Random predictions at the three strides of a ``size`` image (P = 336 at 128 px) and
    padded GTs: image ``empty_image`` holds none, the others some padding rows."""
    gen = torch.Generator().manual_seed(seed)
    points, strides = grid_points([(size // s, size // s) for s in (8, 16, 32)], [8, 16, 32])
    p = len(points)
    dist = torch.rand(b, p, 4, generator=gen) * 4 * strides[:, None]
    boxes = torch.cat([points - dist[..., :2], points + dist[..., 2:]], -1)
    logits = torch.randn(b, p, 5, generator=gen)
    wh = 8 + torch.rand(b, g, 2, generator=gen) * (size / 2)
    xy = torch.rand(b, g, 2, generator=gen) * (size - wh)
    gts = torch.cat([xy, xy + wh], -1)
    labels = torch.randint(0, 5, (b, g), generator=gen)
    mask = torch.rand(b, g, generator=gen) > 0.25
    mask[empty_image] = False
    return logits, boxes, points, labels, gts, mask


@pytest.mark.parametrize("chunk_pairs", [1, 336 * 2 + 5, 336 * 4, 336 * 9 * 2 + 100])
def test_chunked_assignment_equals_unchunked(chunk_pairs):
    """One GT per chunk, several GTs of one image with an uneven last chunk, and whole
    images per chunk (uneven again): bit for bit the assignment of a single chunk."""
    logits, boxes, points, labels, gts, mask = _dense_case()
    whole = point_targets(TaskAlignedAssigner(topk=7, chunk_pairs=10**9), logits, boxes, points, labels, gts, mask,
                                                                         logits=True)
    parts = point_targets(TaskAlignedAssigner(topk=7, chunk_pairs=chunk_pairs), logits, boxes, points, labels, gts,
                                                                                mask, logits=True)
    assert whole.foreground.sum() > 40 and not whole.foreground[1].any()
    for name in whole._fields:
        assert torch.equal(getattr(parts, name), getattr(whole, name)), name


def test_flat_rows_in_any_order_equal_padded_rows():
    """``assign_rows`` on shuffled flat targets (copied predictions per GT, in chunks) gives
    the assignment of the padded ones."""
    logits, boxes, points, labels, gts, mask = _dense_case()
    tal = TaskAlignedAssigner(topk=7, chunk_pairs=700)
    padded = point_targets(tal, logits, boxes, points, labels, gts, mask, logits=True)
    image, slot = mask.nonzero(as_tuple=True)
    perm = torch.randperm(len(image), generator=torch.Generator().manual_seed(0))
    image, slot = image[perm], slot[perm]
    rows = tal.assign_rows(logits, boxes, points, image, labels[image, slot], gts[image, slot], logits=True)
    foreground = rows.point_row < len(image)
    assert torch.equal(foreground, padded.foreground)
    assert torch.equal(rows.point_weights, padded.weights)
    fg_image = torch.arange(3)[:, None].expand_as(foreground)[foreground]
    assert torch.equal(image[rows.point_row[foreground]], fg_image)
    assert torch.equal(slot[rows.point_row[foreground]], padded.gt_index[foreground])
    # the per-GT form holds the same positives and weights
    assert rows.positive.sum() == foreground.sum()
    key = image[:, None] * len(points) + rows.points
    assert torch.equal(rows.weights[rows.positive], rows.point_weights.view(-1)[key[rows.positive]])


def test_chunks_bound_the_largest_tensor():
    """Memory: with 150 GTs per image and 2,000-pair chunks no intermediate tensor holds
    more than a chunk's worth or the O(B * P) box terms of the predictions, while the
    unchunked form makes tensors of B * G * P."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargestOutput(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel())
            return out

    logits, boxes, points, labels, gts, mask = _dense_case(b=2, g=150, empty_image=0)
    b, p, _ = logits.shape
    for chunk_pairs, bound in ((2000, 2000), (10**9, None)):
        with LargestOutput() as mode:
            point_targets(TaskAlignedAssigner(chunk_pairs=chunk_pairs), logits, boxes, points, labels, gts, mask)
        if bound:
            assert mode.largest <= max(bound, 6 * b * p), mode.largest
        else:
            assert mode.largest >= b * 150 * p


def test_assigner_reads_nothing_back():
    from _host_sync import count_host_syncs  # tests/ is put on sys.path by tests/losses/conftest.py

    logits, boxes, points, labels, gts, mask = _dense_case()
    tal = TaskAlignedAssigner(chunk_pairs=1000)
    targets = torch.cat([torch.tensor([[0.0, 1, 10, 10, 60, 50], [2, 3, 0, 0, 128, 128]])])
    with count_host_syncs() as syncs:
        dense_assignment(tal, logits.sigmoid(), boxes, points, labels, gts, mask)
        point_targets(tal, logits, boxes, points, labels, gts, mask, logits=True)
        pad_targets(targets, 3, max_boxes=2)
    assert not syncs, dict(syncs)


def test_pad_targets_with_max_boxes():
    t = torch.tensor([[2, 1, 0, 0, 4, 4], [0, 3, 1, 1, 2, 2], [2, 0, 5, 5, 9, 9], [2, 2, 6, 6, 7, 7.0]])
    read, given = pad_targets(t, 4), pad_targets(t, 4, max_boxes=5)
    assert given.boxes.shape == (4, 5, 4) and not given.mask[:, 3:].any()
    for a, b in zip(read, given, strict=True):
        assert torch.equal(b[:, :3], a)
    with pytest.raises(IndexError):
        pad_targets(t, 4, max_boxes=2)  # image 2 holds three boxes
    with pytest.raises(ValueError, match="image index -1"):
        pad_targets(torch.tensor([[-1, 0, 0, 0, 1, 1.0]]), 3)

