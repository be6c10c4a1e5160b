import itertools

import pytest
import torch

from yolokit.data.augment.transforms import scale_boxes
from yolokit.ops.geometry import LetterboxPlan, letterbox_plan, unletterbox_boxes


def test_plan_hand_cases():
    assert letterbox_plan((480, 640), 320) == LetterboxPlan((240, 320), (320, 320), (0, 40, 0, 40), (0.5, 0.5))
    # odd sizes: 333x500 into (256, 320) -> r = 0.64, h 213.12 -> 213; 43 rows of padding, 21 on top
    plan = letterbox_plan((333, 500), (256, 320))
    assert plan == LetterboxPlan((213, 320), (256, 320), (0, 21, 0, 22), (320 / 500, 213 / 333))
    assert plan.ratio_pad == ((0.64, 213 / 333), (0.0, 21.0))
    assert letterbox_plan((333, 500), (256, 320), auto=True).shape == (224, 320)  # 213 -> 7 * 32
    assert letterbox_plan((333, 500), 640, auto=True, stride=64).pad == (0, 11, 0, 11)  # 426 -> 448
    assert letterbox_plan((333, 500), 320, auto=True, stride=64).pad == (0, 21, 0, 22)  # 213 -> 256
    # no scaleup: a small image stays as it is, centred; odd padding goes right and bottom
    assert letterbox_plan((101, 51), 320, scaleup=False) == LetterboxPlan((101, 51), (320, 320),
                                                                         (134, 109, 135, 110), (1.0, 1.0))
    # a sliver keeps at least one pixel; Python's round (half to even) decides the sizes
    assert letterbox_plan((1, 1000), 100).size == (1, 100)
    assert letterbox_plan((5, 2), (2, 100)).size == (2, 1)  # 2 * 0.4 = 0.8 -> 1


@pytest.mark.parametrize("h, w", [(1, 1), (7, 13), (333, 500), (97, 61), (640, 480), (31, 32), (100, 1)])
def test_every_plan_is_consistent(h, w):
    for new_shape, auto, scaleup in itertools.product([64, (96, 200), (65, 33)], [False, True], [False, True]):
        plan = letterbox_plan((h, w), new_shape, stride=32, auto=auto, scaleup=scaleup)
        (nh, nw), (oh, ow), (left, top, right, bottom) = plan.size, plan.shape, plan.pad
        assert (nh + top + bottom, nw + left + right) == (oh, ow)
        assert min(left, top, right, bottom) >= 0 and 0 <= right - left <= 1 and 0 <= bottom - top <= 1
        assert plan.ratio == (nw / w, nh / h)
        if auto:
            assert oh % 32 == 0 and ow % 32 == 0 and oh - nh < 32 and ow - nw < 32
        if not scaleup:
            assert nh <= h and nw <= w


def test_boxes_there_and_back():
    gen = torch.Generator().manual_seed(0)
    xy = torch.rand(20, 2, generator=gen) * torch.tensor([400.0, 300.0])
    boxes = torch.cat((xy, xy + torch.rand(20, 2, generator=gen) * 100), dim=1)
    boxes = boxes.clamp(max=torch.tensor([500.0, 333] * 2))
    for new_shape, auto in [(320, False), ((256, 320), True), (640, False)]:
        ratio_pad = letterbox_plan((333, 500), new_shape, auto=auto).ratio_pad
        there = torch.from_numpy(scale_boxes(boxes.numpy(), *ratio_pad))
        torch.testing.assert_close(unletterbox_boxes(there, ratio_pad, (333, 500)), boxes, atol=1e-3, rtol=0)
    # original 200x100 (h, w) letterboxed into 64x64: ratio 0.32, padded 16 px left; clipped
    lb = torch.tensor([[16.0 + 3.2, 6.4, 16.0 + 16.0, 32.0], [0.0, 0.0, 64.0, 64.0]])
    back = unletterbox_boxes(lb, ((0.32, 0.32), (16.0, 0.0)), (200, 100))
    torch.testing.assert_close(back, torch.tensor([[10.0, 20.0, 50.0, 100.0], [0.0, 0.0, 100.0, 200.0]]))
