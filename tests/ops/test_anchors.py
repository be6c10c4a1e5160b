import torch

from yolokit.ops.anchors import box_to_dist, dist_to_box, grid_points


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
    for value, (x, y) in zip(flat.tolist(), points.tolist()):
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
