"""Tests of losses/yolov8.py: hand-computed values, edge cases, gradients, autocast."""

from __future__ import annotations

import math

import pytest
import torch
from _dense_assignment import dense_assignment, point_targets  # tests/ is on sys.path (tests/conftest.py)

from yolokit.losses import YOLOv8Loss
from yolokit.losses.yolov8 import distribution_focal_loss
from yolokit.ops.anchors import dist_to_box, grid_points

C, R = 2, 4  # classes, bins in the small hand cases
STRIDES = (8, 16, 32)


def _ciou_py(a, b, eps=1e-7):
    """CIoU of two xyxy boxes in plain Python floats (independent of yolokit.ops)."""
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    iou = inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter + eps)
    diag2 = (max(a[2], b[2]) - min(a[0], b[0])) ** 2 + (max(a[3], b[3]) - min(a[1], b[1])) ** 2
    rho2 = ((a[0] + a[2] - b[0] - b[2]) ** 2 + (a[1] + a[3] - b[1] - b[3]) ** 2) / 4
    v = 4 / math.pi**2 * (math.atan((b[2] - b[0]) / (b[3] - b[1])) - math.atan((a[2] - a[0]) / (a[3] - a[1]))) ** 2
    return iou - rho2 / diag2 - v / (v - iou + 1) * v


def _random_maps(gen, b=2, size=64, c=3, reg_max=16, requires_grad=False):
    maps = [torch.randn(b, 4 * reg_max + c, size // s, size // s, generator=gen) for s in STRIDES]
    return [m.requires_grad_(requires_grad) for m in maps]


def _random_targets(gen, batch, per_image, size, classes, min_wh=4.0, max_wh=None):
    n = batch * per_image
    max_wh = max_wh or size / 2
    wh = min_wh + torch.rand(n, 2, generator=gen) * (max_wh - min_wh)
    xy = torch.rand(n, 2, generator=gen) * (size - wh)
    image = torch.arange(batch).repeat_interleave(per_image).float()
    cls = torch.randint(0, classes, (n,), generator=gen).float()
    return torch.cat([image[:, None], cls[:, None], xy, xy + wh], dim=1)


def _one_level_case():
    """One 2x2 level at stride 8, R=4 bins, C=2, all logits 0 except the first point's
    box distributions, which are [0, ln 2, 0, 0] on every side (probabilities 1/5, 2/5,
    1/5, 1/5; expected distance 1.4 strides = 11.2 px)."""
    maps = torch.zeros(1, 4 * R + C, 2, 2)
    maps[0, [s * R + 1 for s in range(4)], 0, 0] = math.log(2)
    targets = torch.tensor([[0, 1, 1.0, 1.0, 9.0, 9.0]])  # only point (4, 4) is inside
    return maps, targets


def test_one_gt_hand_computed():
    maps, targets = _one_level_case()
    total, parts = YOLOv8Loss(C, (8,), reg_max=R)([maps], targets)
    pred = [4 - 11.2, 4 - 11.2, 4 + 11.2, 4 + 11.2]
    u = _ciou_py(pred, [1.0, 1.0, 9.0, 9.0])
    assert 0 < u < 1
    t = 0.5**0.5 * u**6  # class logit 0: score 0.5
    w = t * u / (t + 1e-9)  # a lone positive: t * max u / (max t + eps); S = max(w, 1) = 1
    cls = 4 * C * math.log(2) / 1  # every class logit is 0, so BCE = ln 2 whatever the target
    box = (1 - u) * w
    # target distances in strides: l = t = (4 - 1) / 8, r = b = (9 - 4) / 8; bins 0 and 1
    p0, p1 = 1 / 5, 2 / 5
    side = lambda d: -((1 - d) * math.log(p0) + d * math.log(p1))  # noqa: E731
    dfl = (2 * side(3 / 8) + 2 * side(5 / 8)) / 4 * w
    assert parts["cls"].item() == pytest.approx(0.5 * cls, rel=1e-5)
    assert parts["box"].item() == pytest.approx(7.5 * box, rel=1e-4)
    assert parts["dfl"].item() == pytest.approx(1.5 * dfl, rel=1e-5)
    assert total.item() == pytest.approx(sum(p.item() for p in parts.values()), rel=1e-6)


def test_distribution_focal_loss_splits_between_neighbour_bins():
    logits = torch.tensor([[[0.0, math.log(2), 0.0, 0.0]] * 4])
    target = torch.tensor([[0.25, 1.0, 1.5, 2.99]])
    lp = [math.log(v) for v in (0.2, 0.4, 0.2, 0.2)]
    sides = [0.75 * lp[0] + 0.25 * lp[1], lp[1], 0.5 * lp[1] + 0.5 * lp[2], 0.01 * lp[2] + 0.99 * lp[3]]
    expected = -sum(sides) / 4
    assert distribution_focal_loss(logits, target).item() == pytest.approx(expected, rel=1e-5)


def test_empty_gt_gives_zero_box_and_dfl():
    gen = torch.Generator().manual_seed(0)
    maps = _random_maps(gen, requires_grad=True)
    total, parts = YOLOv8Loss(3, STRIDES)(maps, torch.zeros(0, 6))
    assert parts["box"].item() == 0.0 and parts["dfl"].item() == 0.0
    assert parts["cls"].item() > 0 and torch.isfinite(total)
    total.backward()
    for m in maps:
        assert m.grad[:, :64].abs().sum() == 0 and m.grad[:, 64:].abs().min() > 0


@pytest.mark.parametrize("chunk_pairs", [None, 1])
def test_a_batch_without_boxes_given_max_boxes_0(chunk_pairs):
    """What the trainer passes for a batch of background images (it crashed with a division by zero)."""
    gen = torch.Generator().manual_seed(0)
    maps = _random_maps(gen)
    loss = YOLOv8Loss(3, STRIDES)
    loss.assigner.chunk_pairs = chunk_pairs
    _, unbounded = loss(maps, torch.zeros(0, 6))
    total, parts = loss(maps, torch.zeros(0, 6), max_boxes=0)
    assert parts == unbounded and parts["box"].item() == 0.0 and parts["cls"].item() > 0


def test_invariant_to_gt_order():
    gen = torch.Generator().manual_seed(1)
    maps = _random_maps(gen, b=3, size=96)
    targets = _random_targets(gen, 3, 6, 96, 3, min_wh=16)
    loss = YOLOv8Loss(3, STRIDES)
    total, parts = loss(maps, targets)
    perm = torch.randperm(len(targets), generator=gen)
    total2, parts2 = loss(maps, targets[perm])
    assert parts["box"] > 0
    torch.testing.assert_close(total2, total)
    for k in parts:
        torch.testing.assert_close(parts2[k], parts[k])


def test_gradients_reach_box_channels_only_at_positive_points():
    gen = torch.Generator().manual_seed(2)
    maps = _random_maps(gen, b=2, size=64, requires_grad=True)
    targets = torch.tensor([[1, 2, 10.0, 14.0, 50.0, 44.0]])
    loss = YOLOv8Loss(3, STRIDES)
    total, _ = loss(maps, targets)
    total.backward()

    # the assignment the loss saw, rebuilt from the same maps
    with torch.no_grad():
        flat = torch.cat([m.flatten(2) for m in maps], 2).transpose(1, 2)
        points, strides = grid_points([m.shape[-2:] for m in maps], STRIDES)
        dist = flat[..., :64].reshape(2, -1, 4, 16).softmax(-1) @ torch.arange(16.0)
        boxes = dist_to_box(dist * strides[:, None], points)
        gt = (torch.tensor([[0], [2]]), torch.tensor([[[0.0] * 4], [[10.0, 14.0, 50.0, 44.0]]]),
              torch.tensor([[False], [True]]))
        fg = dense_assignment(loss.assigner, flat[..., 64:].sigmoid(), boxes, points, *gt).foreground
    grads = torch.cat([m.grad.flatten(2) for m in maps], 2).transpose(1, 2)  # [B, P, 67]
    box_grad = grads[..., :64].abs().sum(-1) > 0
    assert fg.sum() >= 3 and not fg[0].any()
    assert torch.equal(box_grad, fg)
    assert (grads[..., 64:].abs() > 0).all()


@pytest.mark.parametrize("case", ["no_gt", "some_empty_images", "tiny", "border", "many"])
def test_edge_cases_are_finite(case):
    gen = torch.Generator().manual_seed(4)
    size = 128 if case == "many" else 64
    maps = _random_maps(gen, b=3, size=size, requires_grad=True)
    if case == "no_gt":
        targets = torch.zeros(0, 6)
    elif case == "some_empty_images":
        targets = _random_targets(gen, 1, 4, size, 3, min_wh=10)  # only image 0 has boxes
    elif case == "tiny":
        targets = torch.tensor([[0, 0, 10, 10, 10.4, 10.6], [1, 1, 12, 12, 12.0, 12.5], [2, 2, 3, 4, 4, 4.9]])
    elif case == "border":
        targets = torch.tensor([[0, 0, 0, 0, 64, 64], [1, 1, 0, 30, 20, 64], [2, 2, 50, 0, 64, 10.0]])
    else:
        targets = _random_targets(gen, 3, 250, size, 3, min_wh=2, max_wh=40)
    total, parts = YOLOv8Loss(3, STRIDES)(maps, targets)
    assert torch.isfinite(total) and all(torch.isfinite(p) for p in parts.values())
    total.backward()
    assert all(torch.isfinite(m.grad).all() for m in maps)
    if case in ("border", "many"):
        assert parts["box"] > 0 and parts["dfl"] > 0


def test_rejects_wrong_channels():
    with pytest.raises(ValueError, match="4 \\* reg_max"):
        YOLOv8Loss(3, (8,))([torch.zeros(1, 60, 4, 4)], torch.zeros(0, 6))


def test_channels_last_maps_give_the_same_loss():
    gen = torch.Generator().manual_seed(5)
    maps = _random_maps(gen)
    targets = _random_targets(gen, 2, 3, 64, 3, min_wh=12)
    loss = YOLOv8Loss(3, STRIDES)
    ref, _ = loss(maps, targets)
    total, _ = loss([m.to(memory_format=torch.channels_last) for m in maps], targets)
    torch.testing.assert_close(total, ref)


def test_class_term_is_dense_bce_against_the_assigners_soft_targets():
    """The class term (summed softplus minus the sparse target term) equals BCE-with-logits
    summed against the targets of the assignment per point (tests/_dense_assignment.py)."""
    import torch.nn.functional as F

    from yolokit.losses import pad_targets

    gen = torch.Generator().manual_seed(6)
    maps = _random_maps(gen, b=2, size=64)
    targets = _random_targets(gen, 2, 4, 64, 3, min_wh=10)
    loss = YOLOv8Loss(3, STRIDES)
    _, parts = loss(maps, targets)
    with torch.no_grad():
        flat = torch.cat([m.flatten(2) for m in maps], 2).transpose(1, 2)
        points, strides = grid_points([m.shape[-2:] for m in maps], STRIDES)
        dist = flat[..., :64].reshape(2, -1, 4, 16).softmax(-1) @ torch.arange(16.0)
        boxes = dist_to_box(dist * strides[:, None], points)
        assigned = dense_assignment(loss.assigner, flat[..., 64:].sigmoid(), boxes, points, *pad_targets(targets, 2))
    bce = F.binary_cross_entropy_with_logits(flat[..., 64:], assigned.scores, reduction="sum")
    expected = bce / assigned.scores.sum().clamp(min=1) * loss.gains["cls"]
    torch.testing.assert_close(parts["cls"], expected, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- host reads, padding, chunks


def _foreground_form(loss, maps, targets):
    """The loss as it was computed with a data-dependent foreground list (``nonzero``) over
    the padded targets: the reference for the fixed-size form the loss uses now."""
    import torch.nn.functional as F

    from yolokit.losses import pad_targets
    from yolokit.losses.yolov8 import distribution_focal_loss as dfl_fn
    from yolokit.ops.anchors import box_to_dist
    from yolokit.ops.boxes import ciou

    b, r = maps[0].shape[0], loss.reg_max
    flat = torch.cat([m.flatten(2) for m in maps], 2)  # [B, 4R + C, P]
    p = flat.shape[-1]
    box_logits, cls_logits = flat[:, : 4 * r].reshape(b, 4, r, p), flat[:, 4 * r:]
    points, strides = grid_points([m.shape[-2:] for m in maps], loss.strides)
    bins = torch.arange(r, dtype=torch.float32)
    with torch.no_grad():
        dist = torch.matmul(bins, box_logits.softmax(2)).transpose(1, 2)
        boxes = dist_to_box(dist * strides[:, None], points)
        assigned = point_targets(loss.assigner, cls_logits.transpose(1, 2), boxes, points,
                                 *pad_targets(targets, b), logits=True)
    s = assigned.weights.sum().clamp(min=1.0)
    fi, fp = assigned.foreground.nonzero(as_tuple=True)
    w = assigned.weights[fi, fp]
    cls = (F.softplus(cls_logits).sum() - (cls_logits[fi, assigned.labels[fi, fp], fp] * w).sum()) / s
    logits = box_logits[fi, :, :, fp]
    pred = dist_to_box((logits.softmax(-1) @ bins) * strides[fp, None], points[fp])
    target = assigned.boxes[fi, fp]
    box = ((1 - ciou(pred, target)) * w).sum() / s
    tdist = box_to_dist(target / strides[fp, None], points[fp] / strides[fp, None], max_dist=r - 1.01)
    dfl = (dfl_fn(logits, tdist) * w).sum() / s
    return {"box": box * loss.gains["box"], "cls": cls * loss.gains["cls"], "dfl": dfl * loss.gains["dfl"]}


@pytest.mark.parametrize("per_image", [4, 40])  # N * k below B * P (each GT's points), and above (every point)
def test_equals_the_foreground_form_padded_or_not(per_image):
    gen = torch.Generator().manual_seed(8)
    maps = _random_maps(gen, b=3, size=64, requires_grad=True)
    targets = _random_targets(gen, 3, per_image, 64, 3, min_wh=6, max_wh=40)
    targets = targets[targets[:, 0] != 1]  # image 1 holds no box
    targets = targets[torch.randperm(len(targets), generator=gen)]
    loss = YOLOv8Loss(3, STRIDES)
    assert (len(targets) * 10 > 3 * 84) == (per_image == 40)
    expected = _foreground_form(loss, maps, targets)
    grads = torch.autograd.grad(sum(expected.values()), maps)
    assert expected["box"] > 0 and expected["dfl"] > 0
    for max_boxes in (None, per_image, per_image + 3):
        total, parts = loss(maps, targets, max_boxes=max_boxes)
        for k in expected:
            torch.testing.assert_close(parts[k], expected[k].detach(), rtol=1e-5, atol=1e-6)
        for g, want in zip(torch.autograd.grad(total, maps), grads, strict=True):
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-8)


def test_chunking_leaves_the_loss_unchanged():
    gen = torch.Generator().manual_seed(9)
    maps = _random_maps(gen, b=2, size=96)
    targets = _random_targets(gen, 2, 30, 96, 3, min_wh=4, max_wh=60)
    one, many = YOLOv8Loss(3, STRIDES), YOLOv8Loss(3, STRIDES)
    one.assigner.chunk_pairs, many.assigner.chunk_pairs = 10**9, 500  # P = 189: two GTs at a time
    for max_boxes in (None, 30):
        total, parts = many(maps, targets, max_boxes=max_boxes)
        ref_total, ref_parts = one(maps, targets, max_boxes=max_boxes)
        assert torch.equal(total, ref_total) and all(torch.equal(parts[k], ref_parts[k]) for k in parts)


@pytest.mark.parametrize("max_boxes", [None, 7])
def test_a_step_reads_nothing_back(max_boxes):
    from _host_sync import count_host_syncs  # tests/ is put on sys.path by tests/losses/conftest.py

    gen = torch.Generator().manual_seed(10)
    maps = _random_maps(gen, b=2, size=64, requires_grad=True)
    targets = _random_targets(gen, 2, 7, 64, 3, min_wh=8)
    loss = YOLOv8Loss(3, STRIDES)
    with count_host_syncs() as syncs:
        total, parts = loss(maps, targets, max_boxes=max_boxes)
        total.backward()
    assert not syncs, dict(syncs)
    assert parts["box"] > 0


def test_too_small_max_boxes_raises():
    gen = torch.Generator().manual_seed(10)
    with pytest.raises(IndexError):
        YOLOv8Loss(3, STRIDES)(_random_maps(gen), _random_targets(gen, 2, 7, 64, 3), max_boxes=6)


@pytest.mark.gpu
def test_a_cuda_step_never_synchronizes():
    gen = torch.Generator().manual_seed(10)
    maps = [m.cuda().requires_grad_() for m in _random_maps(gen, b=2, size=64)]
    targets = _random_targets(gen, 2, 7, 64, 3, min_wh=8).cuda()
    loss = YOLOv8Loss(3, STRIDES).cuda()
    loss(maps, targets)  # first call: lazy CUDA initialisation may synchronize
    torch.cuda.set_sync_debug_mode("error")
    try:
        for max_boxes in (None, 7):
            total, _ = loss(maps, targets, max_boxes=max_boxes)
            total.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
