"""Tests of losses/yolov3.py: hand-computed values, ignore rule, gradients, edge cases."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from yolokit.losses import YOLOv3Loss
from yolokit.ops.boxes import box_iou

TINY = (((23, 27), (37, 58), (81, 82)), ((81, 82), (135, 169), (344, 319)))
TINY_STRIDES = (16, 32)
FULL = (((10, 13), (16, 30), (33, 23)), ((30, 61), (62, 45), (59, 119)), ((116, 90), (156, 198), (373, 326)))
FULL_STRIDES = (8, 16, 32)
C = 2


def _ciou_py(a, b):
    """CIoU of two xyxy boxes in plain Python floats (independent of yolokit.ops)."""
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    iou = inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)
    diag2 = (max(a[2], b[2]) - min(a[0], b[0])) ** 2 + (max(a[3], b[3]) - min(a[1], b[1])) ** 2
    rho2 = ((a[0] + a[2] - b[0] - b[2]) ** 2 + (a[1] + a[3] - b[1] - b[3]) ** 2) / 4
    v = 4 / math.pi**2 * (math.atan((b[2] - b[0]) / (b[3] - b[1])) - math.atan((a[2] - a[0]) / (a[3] - a[1]))) ** 2
    return iou - rho2 / diag2 - v / (v - iou + 1) * v


def _maps(anchors, strides, size, b=1, fill=None, gen=None, scale=0.5, requires_grad=False):
    out = []
    for a, s in zip(anchors, strides, strict=True):
        shape = (b, len(a) * (5 + C), size // s, size // s)
        m = torch.zeros(shape) if fill is not None else torch.randn(shape, generator=gen) * scale
        out.append(m.requires_grad_(requires_grad))
    return out


def _decode_py(maps, anchors, strides):
    """Per image, a list of (level, anchor, row, col, xyxy box) over all predictions."""
    rows = []
    for lvl, (m, a, s) in enumerate(zip(maps, anchors, strides, strict=True)):
        b, _, h, w = m.shape
        v = m.detach().view(b, len(a), 5 + C, h, w)
        for j, (aw, ah) in enumerate(a):
            for y in range(h):
                for x in range(w):
                    tx, ty, tw, th = v[:, j, :4, y, x].unbind(-1)
                    cx, cy = (tx.sigmoid() + x) * s, (ty.sigmoid() + y) * s
                    bw, bh = tw.exp() * aw, th.exp() * ah
                    rows.append(((lvl, j, y, x), torch.stack([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2], -1)))
    return rows


# A 20x30 GT centred at (20, 28): best anchor (23, 27) = level 0 anchor 0, cell (1, 1).
GT = [10.0, 13.0, 30.0, 43.0]


def test_one_gt_hand_computed_ciou():
    maps = _maps(TINY, TINY_STRIDES, 64, fill=0)
    total, parts = YOLOv3Loss(C, TINY, TINY_STRIDES)(maps, torch.tensor([[0, 1] + GT]))
    pred = [24 - 11.5, 24 - 13.5, 24 + 11.5, 24 + 13.5]  # cell (1, 1) centre, anchor size
    u = _ciou_py(pred, GT)
    q = 3 * 16 + 3 * 4  # predictions
    assert parts["box"].item() == pytest.approx(1 - u, rel=1e-5)
    assert parts["cls"].item() == pytest.approx(C * math.log(2), rel=1e-6)  # logits 0 at the positive
    assert parts["obj"].item() == pytest.approx(q * math.log(2), rel=1e-6)  # nothing above 0.7 IoU
    assert total.item() == pytest.approx(sum(p.item() for p in parts.values()), rel=1e-6)


def test_one_gt_hand_computed_mse():
    maps = _maps(TINY, TINY_STRIDES, 64, fill=0)
    _, parts = YOLOv3Loss(C, TINY, TINY_STRIDES, box="mse")(maps, torch.tensor([[0, 1] + GT]))
    err = (0.5 - 0.25) ** 2 + (0.5 - 0.75) ** 2 + math.log(20 / 23) ** 2 + math.log(30 / 27) ** 2
    assert parts["box"].item() == pytest.approx((2 - 600 / 64**2) * err, rel=1e-5)


def test_ignore_threshold_drops_overlapping_unassigned_predictions():
    maps = _maps(TINY, TINY_STRIDES, 64, fill=0)
    targets = torch.tensor([[0, 1] + GT])
    for thresh in (0.7, 0.3, 0.1):
        _, parts = YOLOv3Loss(C, TINY, TINY_STRIDES, ignore_thresh=thresh)(maps, targets)
        rows = _decode_py(maps, TINY, TINY_STRIDES)
        ious = box_iou(torch.stack([r[1][0] for r in rows]), torch.tensor([GT]))[:, 0]
        ignored = sum(1 for (key, _), v in zip(rows, ious, strict=True) if v > thresh and key != (0, 0, 1, 1))
        assert parts["obj"].item() == pytest.approx((len(rows) - ignored) * math.log(2), rel=1e-6)
        if thresh == 0.1:
            assert ignored >= 3


def test_two_gts_on_one_anchor_train_both_classes():
    maps = _maps(TINY, TINY_STRIDES, 64, fill=0)
    maps[0][0, 5:7, 1, 1] = 2.0  # anchor 0 class logits at cell (1, 1)
    targets = torch.tensor([[0, 0] + GT, [0, 1] + [GT[0] + 1, GT[1], GT[2] + 1, GT[3]]])
    _, parts = YOLOv3Loss(C, TINY, TINY_STRIDES)(maps, targets)
    assert parts["cls"].item() == pytest.approx(2 * F.softplus(torch.tensor(-2.0)).item(), rel=1e-6)


@pytest.mark.parametrize("anchors,strides", [(TINY, TINY_STRIDES), (FULL, FULL_STRIDES)])
def test_gradients_reach_exactly_the_right_channels(anchors, strides):
    gen = torch.Generator().manual_seed(0)
    maps = _maps(anchors, strides, 96, b=2, gen=gen, requires_grad=True)
    targets = torch.tensor([[0, 0, 5, 8, 30, 40], [0, 1, 40, 20, 90, 95], [1, 1, 50, 50, 62, 58.0]])
    thresh = 0.3
    total, _ = YOLOv3Loss(C, anchors, strides, ignore_thresh=thresh)(maps, targets)
    total.backward()
    rows = _decode_py(maps, anchors, strides)
    # expected positives from the matcher's definition, computed here by brute force
    flat = [(lvl, j, wh) for lvl, a in enumerate(anchors) for j, wh in enumerate(a)]
    positive = set()
    for img, _, x1, y1, x2, y2 in targets.tolist():
        w, h = x2 - x1, y2 - y1
        scores = [min(w, aw) * min(h, ah) / (w * h + aw * ah - min(w, aw) * min(h, ah)) for _, _, (aw, ah) in flat]
        lvl, j, _ = flat[scores.index(max(scores))]
        s = strides[lvl]
        positive.add((int(img), lvl, j, int((y1 + y2) / 2 // s), int((x1 + x2) / 2 // s)))
    assert len(positive) == 3
    n_ignored = 0
    for (lvl, j, y, x), box in rows:
        g = maps[lvl].grad.view(2, len(anchors[lvl]), 5 + C, *maps[lvl].shape[-2:])[:, j, :, y, x]  # [2, 5 + C]
        for img in range(2):
            gts = targets[targets[:, 0] == img, 2:]
            is_pos = (img, lvl, j, y, x) in positive
            ignored = not is_pos and bool((box_iou(box[img : img + 1], gts) > thresh).any())
            n_ignored += ignored
            if is_pos:  # box and class channels: every one at the assigned slot, none elsewhere
                assert (g[img, :4] != 0).all() and (g[img, 5:] != 0).all()
            else:
                assert (g[img, :4] == 0).all() and (g[img, 5:] == 0).all()
            assert bool(g[img, 4] != 0) == (not ignored)
    assert n_ignored > 0


@pytest.mark.parametrize("box", ["ciou", "mse"])
def test_invariant_to_gt_order(box):
    gen = torch.Generator().manual_seed(1)
    maps = _maps(FULL, FULL_STRIDES, 128, b=3, gen=gen)
    n = 12
    wh = 6 + torch.rand(n, 2, generator=gen) * 60
    xy = torch.rand(n, 2, generator=gen) * (128 - wh)
    targets = torch.cat([torch.arange(3).repeat(4)[:, None].float(), torch.randint(0, C, (n, 1), generator=gen),
                         xy, xy + wh], 1)
    loss = YOLOv3Loss(C, FULL, FULL_STRIDES, box=box)
    total, parts = loss(maps, targets)
    total2, parts2 = loss(maps, targets[torch.randperm(n, generator=gen)])
    torch.testing.assert_close(total2, total)
    for k in parts:
        torch.testing.assert_close(parts2[k], parts[k])


def test_empty_gt_gives_zero_box_and_cls():
    gen = torch.Generator().manual_seed(2)
    maps = _maps(TINY, TINY_STRIDES, 64, b=2, gen=gen, requires_grad=True)
    total, parts = YOLOv3Loss(C, TINY, TINY_STRIDES)(maps, torch.zeros(0, 6))
    assert parts["box"].item() == 0.0 and parts["cls"].item() == 0.0 and parts["obj"].item() > 0
    total.backward()
    for m in maps:
        g = m.grad.view(2, 3, 5 + C, *m.shape[-2:])
        assert g[:, :, 4].abs().min() > 0 and g[:, :, :4].abs().sum() == 0 and g[:, :, 5:].abs().sum() == 0


@pytest.mark.parametrize("box", ["ciou", "mse"])
@pytest.mark.parametrize("case", ["no_gt", "some_empty_images", "tiny", "border", "many", "huge_logits"])
def test_edge_cases_are_finite(case, box):
    gen = torch.Generator().manual_seed(4)
    size = 128 if case == "many" else 64
    maps = _maps(FULL, FULL_STRIDES, size, b=3, gen=gen, scale=40.0 if case == "huge_logits" else 0.5,
                 requires_grad=True)
    targets = {
        "no_gt": torch.zeros(0, 6),
        "some_empty_images": torch.tensor([[1, 0, 3, 4, 30, 20.0]]),
        "tiny": torch.tensor([[0, 0, 10, 10, 10.4, 10.6], [1, 1, 12, 12, 12.0, 12.5], [2, 0, 3, 4, 4, 4.9]]),
        "border": torch.tensor([[0, 0, 0, 0, 64, 64], [1, 1, 0, 30, 20, 64], [2, 1, 50, 0, 64, 10.0]]),
        "huge_logits": torch.tensor([[0, 0, 0, 0, 64, 64], [1, 1, 5, 5, 9, 9.0]]),
    }.get(case)
    if case == "many":
        wh = 1 + torch.rand(750, 2, generator=gen) * 40
        xy = torch.rand(750, 2, generator=gen) * (size - wh)
        targets = torch.cat([torch.arange(3).repeat_interleave(250)[:, None].float(),
                             torch.randint(0, C, (750, 1), generator=gen).float(), xy, xy + wh], 1)
    total, parts = YOLOv3Loss(C, FULL, FULL_STRIDES, box=box)(maps, targets)
    assert torch.isfinite(total) and all(torch.isfinite(p) for p in parts.values())
    total.backward()
    assert all(torch.isfinite(m.grad).all() for m in maps)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="box must be"):
        YOLOv3Loss(C, TINY, TINY_STRIDES, box="giou")
    with pytest.raises(ValueError, match="A \\* \\(5 \\+ C\\)"):
        YOLOv3Loss(C, TINY, TINY_STRIDES)([torch.zeros(1, 20, 4, 4), torch.zeros(1, 21, 2, 2)], torch.zeros(0, 6))


def test_channels_last_maps_give_the_same_loss():
    gen = torch.Generator().manual_seed(5)
    maps = _maps(FULL, FULL_STRIDES, 64, b=2, gen=gen)
    targets = torch.tensor([[0, 0, 5, 8, 30, 40], [1, 1, 20, 10, 60, 50.0]])
    loss = YOLOv3Loss(C, FULL, FULL_STRIDES)
    ref, _ = loss(maps, targets)
    total, _ = loss([m.to(memory_format=torch.channels_last) for m in maps], targets)
    torch.testing.assert_close(total, ref)


def test_host_reads_only_for_padding_and_max_boxes_gives_the_same_loss():
    """Without ``max_boxes`` the one read left is the padding's G (for the ignore rule);
    with it, forward and backward read nothing back, and the loss is the same."""
    from _host_sync import count_host_syncs  # tests/ is put on sys.path by tests/losses/conftest.py

    gen = torch.Generator().manual_seed(6)
    maps = _maps(FULL, FULL_STRIDES, 96, b=3, gen=gen, requires_grad=True)
    targets = torch.tensor([[0, 0, 5, 8, 30, 40], [2, 1, 40, 20, 90, 95], [2, 1, 50, 50, 62, 58.0],
                            [2, 0, 50.5, 50, 62.5, 58.0]])  # the last two share an anchor and a cell
    loss = YOLOv3Loss(C, FULL, FULL_STRIDES, ignore_thresh=0.3)
    results = []
    for max_boxes, reads in ((None, {"tolist": 1}), (3, {}), (5, {})):
        with count_host_syncs() as syncs:
            total, parts = loss(maps, targets, max_boxes=max_boxes)
            grads = torch.autograd.grad(total, maps)
        assert dict(syncs) == reads
        results.append((parts, grads))
    for parts, grads in results[1:]:
        assert all(torch.equal(parts[k], results[0][0][k]) for k in parts)
        assert all(torch.equal(g, want) for g, want in zip(grads, results[0][1], strict=True))
    assert results[0][0]["cls"] > 0
