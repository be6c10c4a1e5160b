import math

import pytest
import torch
import torchvision.ops as tvo

from yolokit.ops.boxes import (
    box_area,
    box_convert,
    box_iou,
    ciou,
    clip_boxes,
    diou,
    giou,
    iou,
)


def random_boxes(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=g) * 100
    wh = torch.rand(n, 2, generator=g) * 50 + 0.5
    return torch.cat((xy, xy + wh), dim=1)


@pytest.mark.parametrize("fmt", ["cxcywh", "xywh"])
def test_box_convert_matches_torchvision_and_round_trips(fmt):
    boxes = random_boxes(20)
    ours = box_convert(boxes, "xyxy", fmt)
    torch.testing.assert_close(ours, tvo.box_convert(boxes, "xyxy", fmt))
    torch.testing.assert_close(box_convert(ours, fmt, "xyxy"), boxes)
    other = "xywh" if fmt == "cxcywh" else "cxcywh"
    torch.testing.assert_close(box_convert(ours, fmt, other), tvo.box_convert(boxes, "xyxy", other))


def test_box_convert_hand_case_and_bad_format():
    assert box_convert(torch.tensor([10.0, 20.0, 4.0, 6.0]), "cxcywh", "xyxy").tolist() == [8, 17, 12, 23]
    assert box_convert(torch.tensor([1.0, 2.0, 3.0, 4.0]), "xywh", "xyxy").tolist() == [1, 2, 4, 6]
    with pytest.raises(ValueError, match="xyhw"):
        box_convert(torch.zeros(1, 4), "xyhw", "xyxy")


def test_box_area_and_iou_match_torchvision():
    a, b = random_boxes(15, 1), random_boxes(9, 2)
    torch.testing.assert_close(box_area(a), tvo.box_area(a))
    torch.testing.assert_close(box_iou(a, b), tvo.box_iou(a, b), atol=1e-6, rtol=1e-5)
    assert box_iou(a, b).shape == (15, 9)


def test_aligned_family_matches_torchvision_losses():
    a, b = random_boxes(30, 3), random_boxes(30, 4)
    torch.testing.assert_close(iou(a, b), tvo.box_iou(a, b).diagonal(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(1 - giou(a, b), tvo.generalized_box_iou_loss(a, b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(1 - diou(a, b), tvo.distance_box_iou_loss(a, b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(1 - ciou(a, b), tvo.complete_box_iou_loss(a, b), atol=1e-5, rtol=1e-5)


def test_hand_computed_cases():
    a = torch.tensor([[0.0, 0.0, 2.0, 2.0]])
    b = torch.tensor([[1.0, 1.0, 3.0, 3.0]])
    # intersection 1, union 7, enclosing 9, centre distance^2 = 2, diagonal^2 = 18
    assert iou(a, b).item() == pytest.approx(1 / 7, abs=1e-6)
    assert giou(a, b).item() == pytest.approx(1 / 7 - 2 / 9, abs=1e-6)
    assert diou(a, b).item() == pytest.approx(1 / 7 - 2 / 18, abs=1e-6)
    assert ciou(a, b).item() == pytest.approx(1 / 7 - 2 / 18, abs=1e-6)  # same aspect: v = 0
    # different aspect ratios: v = 4/pi^2 (atan(1) - atan(2))^2 on identical centres
    c = torch.tensor([[0.0, 0.0, 2.0, 2.0]])
    d = torch.tensor([[0.5, 0.0, 1.5, 2.0]])
    v = 4 / math.pi**2 * (math.atan(0.5) - math.atan(1.0)) ** 2
    u = 0.5
    assert ciou(c, d).item() == pytest.approx(u - v * v / (v - u + 1), abs=1e-5)
    assert iou(a, a).item() == pytest.approx(1.0, abs=1e-6)


def test_degenerate_boxes_are_finite():
    point = torch.tensor([[5.0, 5.0, 5.0, 5.0]])
    inverted = torch.tensor([[4.0, 4.0, 2.0, 2.0]])
    normal = torch.tensor([[0.0, 0.0, 10.0, 10.0]])
    assert box_area(inverted).item() == 0
    assert box_iou(point, normal).item() == 0
    assert box_iou(point, point).item() == 0
    for fn in (iou, giou, diou, ciou):
        out = fn(torch.cat((point, inverted)), torch.cat((point, normal)))
        assert torch.isfinite(out).all(), fn.__name__


def test_half_precision_is_upcast():
    a = torch.tensor([[0.0, 0.0, 300.0, 300.0]], dtype=torch.float16)
    b = torch.tensor([[100.0, 100.0, 400.0, 400.0]], dtype=torch.float16)
    # areas of 90000 overflow float16 (max 65504) without the upcast
    assert box_area(a).dtype == torch.float32 and box_area(a).item() == 90000
    assert box_iou(a, b).item() == pytest.approx(40000 / 140000, abs=1e-6)
    assert ciou(a, b).dtype == torch.float32 and torch.isfinite(ciou(a, b)).all()


def test_ciou_gradient_flows_to_predictions():
    pred = random_boxes(5, 5).requires_grad_()
    target = random_boxes(5, 6)
    (1 - ciou(pred, target)).sum().backward()
    assert torch.isfinite(pred.grad).all() and pred.grad.abs().sum() > 0


def test_clip_boxes():
    boxes = torch.tensor([[-5.0, 10.0, 50.0, 120.0]])
    assert clip_boxes(boxes, (100, 40)).tolist() == [[0, 10, 40, 100]]
    assert boxes.tolist() == [[-5.0, 10.0, 50.0, 120.0]]  # a new tensor


def test_aligned_family_broadcasts():
    a = random_boxes(4, 7)
    b = random_boxes(3, 8)
    out = ciou(a[:, None], b[None])
    assert out.shape == (4, 3)
    torch.testing.assert_close(iou(a[:, None], b[None]), box_iou(a, b))
    with pytest.raises(ValueError, match="broadcastable"):
        iou(random_boxes(4), random_boxes(3))
