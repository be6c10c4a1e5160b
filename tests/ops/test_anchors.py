import pytest
import torch

from yolokit.ops.anchors import (
    MAX_LOG_SCALE,
    anchor_to_box,
    box_to_dist,
    dfl_expectation,
    dist_to_box,
    grid_points,
)


def test_grid_points_order_and_strides():
    points, strides = grid_points([(2, 3), (1, 2)], [8, 16])
    assert points.shape == (8, 2) and strides.tolist() == [8] * 6 + [16] * 2
    assert points[:3].tolist() == [[4, 4], [12, 4], [20, 4]]  # first row, x inner
    assert points[3].tolist() == [4, 12]
    assert points[6:].tolist() == [[8, 8], [24, 8]]


def test_grid_points_match_flattened_map():
    fmap = torch.arange(12.0).view(1, 1, 3, 4)
    points, _ = grid_points([(3, 4)], [1], offset=0.0)
    flat = fmap.flatten(2)[0, 0]
    for value, (x, y) in zip(flat.tolist(), points.tolist(), strict=True):
        assert fmap[0, 0, int(y), int(x)].item() == value


def test_dist_box_round_trip_and_clamp():
    points = torch.tensor([[10.0, 10.0], [50.0, 20.0]])
    boxes = torch.tensor([[0.0, 5.0, 30.0, 12.0], [40.0, 0.0, 100.0, 60.0]])
    dist = box_to_dist(boxes, points)
    assert dist.tolist() == [[10, 5, 20, 2], [10, 20, 50, 40]]
    torch.testing.assert_close(dist_to_box(dist, points), boxes)
    assert box_to_dist(boxes, points, max_dist=15).max().item() == 15
    batched = dist_to_box(dist.expand(3, 2, 4), points)
    assert batched.shape == (3, 2, 4)


def test_dfl_expectation_hand_values():
    big = -1e4  # softmax weight 0
    logits = torch.tensor([[0.0, 0.0, big, big], [big, big, big, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert dfl_expectation(logits).tolist() == [0.5, 3.0, 1.5]
    # the same three distributions with the bins along dim -2 (a [B, 4, R, P] map's layout)
    assert dfl_expectation(logits.T.contiguous(), dim=-2).tolist() == [0.5, 3.0, 1.5]
    assert dfl_expectation(logits, bins=torch.tensor([0.0, 2.0, 4.0, 6.0])).tolist() == [1.0, 6.0, 3.0]
    with pytest.raises(ValueError, match="last two"):
        dfl_expectation(torch.zeros(2, 16, 3, 4), dim=1)


def test_dfl_expectation_equals_what_head_and_loss_computed_before_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    b, r, p = 2, 16, 37
    maps = torch.randn(b, 4 * r, p, generator=gen) * 3
    bins = torch.arange(r, dtype=torch.float32)
    # head and loss (assigner pass), before: bins @ softmax over dim 2 of [B, 4, R, P]
    before = torch.matmul(bins, maps.view(b, 4, r, p).softmax(2))
    assert torch.equal(dfl_expectation(maps.view(b, 4, r, p), dim=-2), before)
    assert torch.equal(dfl_expectation(maps.view(b, 4, r, p), dim=2, bins=bins), before)
    # loss (foreground points), before: softmax(-1) @ bins of [M, 4, R]
    fg = maps.view(b, 4, r, p).permute(0, 3, 1, 2).reshape(-1, 4, r)
    assert torch.equal(dfl_expectation(fg), fg.softmax(-1) @ bins)
    # both layouts mean the same distances
    torch.testing.assert_close(dfl_expectation(fg).view(b, p, 4), before.transpose(1, 2))
    half = maps.half().view(b, 4, r, p)
    assert dfl_expectation(half, dim=-2).dtype == torch.float16


def test_anchor_to_box_hand_values_and_the_one_clamp():
    cells = torch.tensor([[2.0, 1.0]])
    anchor = torch.tensor([[10.0, 6.0]])
    assert anchor_to_box(torch.zeros(1, 4), cells, 8, anchor).tolist() == [[15, 9, 25, 15]]
    t = torch.tensor([[0.0, 0.0, 1e3, -1.0]])
    clamped = anchor_to_box(t, cells, 8, anchor)
    w = torch.tensor(MAX_LOG_SCALE).exp() * 10
    assert torch.isfinite(clamped).all()
    assert clamped[0, 2] - clamped[0, 0] == w  # t_w clamped at MAX_LOG_SCALE
    torch.testing.assert_close(clamped[0, 3] - clamped[0, 1], torch.tensor(-1.0).exp() * 6)
    extra = torch.cat((t, torch.randn(1, 5)), dim=-1)  # (tx, ty, tw, th, obj, cls...): the rest ignored
    assert torch.equal(anchor_to_box(extra, cells, 8, anchor), clamped)


def test_anchor_to_box_equals_what_head_and_loss_computed_before_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    b, a, h, w, s = 2, 3, 5, 7, 16
    t = torch.randn(b, a, h * w, 4, generator=gen) * 2
    assert t.max() < MAX_LOG_SCALE  # the clamp idles
    cells, _ = grid_points([(h, w)], [1], offset=0.0)
    anchors = torch.tensor([[10.0, 13.0], [16.0, 30.0], [33.0, 23.0]]).view(1, a, 1, 2)
    # the head, before: no clamp
    xy = (t[..., :2].sigmoid() + cells) * s
    wh = t[..., 2:4].exp() * anchors
    assert torch.equal(anchor_to_box(t, cells, s, anchors), torch.cat((xy - wh / 2, xy + wh / 2), dim=-1))
    # the loss, before: clamped at 10; with values past the clamp too
    t[0, 0, :3, 2:] = 12.0
    wh = t[..., 2:4].clamp(max=10.0).exp() * anchors
    assert torch.equal(anchor_to_box(t, cells, s, anchors), torch.cat((xy - wh / 2, xy + wh / 2), dim=-1))
