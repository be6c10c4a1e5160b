"""Masks from coefficients and prototypes: at the input, and sampled straight into the original image."""

import pytest
import torch
import torch.nn.functional as F

from yolokit.ops.geometry import letterbox_plan
from yolokit.ops.masks import decode_masks, mask_logits, masks_in_original


def head_output(k=5, m=6, h=16, w=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(k, m, generator=g), torch.randn(m, h, w, generator=g)


def test_masks_at_the_input_are_the_upsampled_logits_above_zero_inside_each_box():
    coefficients, protos = head_output()
    boxes = torch.tensor([[0.0, 0.0, 80.0, 64.0], [10.5, 3.0, 40.0, 30.2], [70.0, 50.0, 72.0, 51.0],
                          [5.0, 5.0, 5.0, 9.0], [-4.0, 60.0, 90.0, 70.0]])
    masks = decode_masks(coefficients, protos, boxes, (64, 80))
    logits = F.interpolate(mask_logits(coefficients, protos)[None], (64, 80), mode="bilinear")[0]
    ys, xs = torch.meshgrid(torch.arange(64.0), torch.arange(80.0), indexing="ij")
    for mask, logit, (x1, y1, x2, y2) in zip(masks, logits, boxes, strict=True):
        inside = (xs >= x1) & (xs < x2) & (ys >= y1) & (ys < y2)
        assert torch.equal(mask, (logit > 0) & inside)
    assert masks[0].any() and not masks[3].any() and masks[2].sum() <= 2      # whole, empty and 2 x 1 boxes
    assert decode_masks(coefficients[:0], protos, boxes[:0], (64, 80)).shape == (0, 64, 80)


def test_masks_in_the_original_are_the_input_masks_where_the_pixels_coincide():
    """An image letterboxed at ratio 1 (only padded): its pixels are input pixels, so the masks sampled in the
    original equal the input's masks cut out of the padding, box for box."""
    coefficients, protos = head_output()
    plan = letterbox_plan((50, 64), 64)                     # 50 x 64 into 64 x 64: 7 rows of padding on top
    assert plan.ratio == (1.0, 1.0) and plan.pad[:2] == (0, 7)
    boxes = torch.tensor([[0.0, 0.0, 64.0, 50.0], [3.0, 4.0, 30.0, 41.0], [40.0, 10.0, 64.0, 20.0],
                          [0.0, 45.0, 10.0, 50.0], [20.0, 20.0, 21.0, 21.0]])
    ours = masks_in_original(coefficients, protos, boxes, plan.ratio_pad, (64, 64), (50, 64))
    shifted = boxes + torch.tensor([0.0, 7.0, 0.0, 7.0])
    at_input = decode_masks(coefficients, protos, shifted, (64, 64))[:, 7:57]
    assert torch.equal(ours, at_input) and ours.any()
    small = masks_in_original(coefficients, protos, boxes, plan.ratio_pad, (64, 64), (50, 64), chunk_pixels=300)
    assert torch.equal(small, ours)                          # chunked by rows, the same pixels


def test_masks_in_a_downscaled_original_agree_with_resizing_the_input_logits():
    """A 240 x 300 image into 64 x 64 (ratio 0.213): sampling once at each original pixel agrees with
    upsampling the logits to the input, cutting the padding off and resizing that to the original (two
    bilinear steps: they part only along edges); each mask stays inside its box in original pixels."""
    coefficients, protos = head_output(seed=1)
    protos = F.interpolate(protos[None, :, ::4, ::4], protos.shape[-2:], mode="bilinear")[0]   # smooth, as trained
    plan = letterbox_plan((240, 300), 64)
    whole = torch.tensor([[0.0, 0.0, 300.0, 240.0]] * 2)
    ours = masks_in_original(coefficients[:2], protos, whole, plan.ratio_pad, (64, 64), (240, 300))
    logits = F.interpolate(mask_logits(coefficients[:2], protos)[None], (64, 64), mode="bilinear")[0]
    top, left = plan.pad[1], plan.pad[0]
    content = logits[:, top:top + plan.size[0], left:left + plan.size[1]]
    twice = F.interpolate(content[None], (240, 300), mode="bilinear")[0] > 0
    iou = (ours & twice).sum((1, 2)) / (ours | twice).sum((1, 2))
    assert (iou > 0.99).all() and (ours.float().mean((1, 2)) > 0.2).all(), iou
    box = torch.tensor([[20.0, 30.5, 200.0, 190.0]])
    cropped = masks_in_original(coefficients[1:2], protos, box, plan.ratio_pad, (64, 64), (240, 300))[0]
    inside = cropped[31:190, 20:200]                     # rows 31 ... 189: a pixel row i is inside when i >= 30.5
    assert torch.equal(inside, ours[1, 31:190, 20:200]) and cropped.sum() == inside.sum() > 0


def grid_sampled(coefficients, protos, boxes, plan, input_size, orig_shape):
    """Masks in the original image by ``F.grid_sample`` at each pixel's centre (an independent reading of the
    same rule: bilinear, borders held), cut to each box's pixels ``ceil(x1) <= i < ceil(x2)``."""
    h, w = orig_shape
    (rw, rh), (pw, ph) = plan.ratio_pad
    gx = ((torch.arange(w, dtype=torch.float64) + 0.5) * rw + pw) / input_size[1] * 2 - 1
    gy = ((torch.arange(h, dtype=torch.float64) + 0.5) * rh + ph) / input_size[0] * 2 - 1
    grid = torch.stack([gx.expand(h, -1), gy[:, None].expand(-1, w)], -1).float()[None]
    logits = mask_logits(coefficients, protos)[:, None]
    sampled = F.grid_sample(logits, grid.expand(len(logits), -1, -1, -1), mode="bilinear", padding_mode="border",
                            align_corners=False)[:, 0] > 0
    ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    x1, y1, x2, y2 = boxes.ceil()[:, :, None, None].unbind(1)
    return sampled & (xs >= x1) & (xs < x2) & (ys >= y1) & (ys < y2)


BOXES = torch.tensor([[0.0, 0.0, 300.0, 240.0], [20.0, 30.5, 200.0, 190.0], [290.0, 5.0, 310.0, 20.0],
                      [50.0, 50.0, 50.0, 80.0], [-10.0, 200.0, 40.0, 260.0]])


def test_mask_crops_are_the_grid_sampled_masks_inside_their_boxes():
    """``mask_crops_in_original`` (separable: along x, then y) agrees with ``grid_sample`` at every pixel centre,
    also when a large box is read in bands of rows; the crops pasted are ``masks_in_original``'s, a selection
    keeps its windows, and validation's compact records equal those of the whole masks."""
    import numpy as np

    from yolokit.ops.masks import mask_crops_in_original
    from yolokit.val.cocoeval import CroppedMasks

    coefficients, protos = head_output(seed=2)
    plan = letterbox_plan((240, 300), 64)
    crops = mask_crops_in_original(coefficients, protos, BOXES, plan.ratio_pad, (64, 64), (240, 300))
    reference = grid_sampled(coefficients, protos, BOXES, plan, (64, 64), (240, 300))
    whole = crops.dense((240, 300))
    assert (whole != reference).sum() <= 2 and whole[0].any() and not whole[3].any()    # rounding at a logit of 0
    banded = mask_crops_in_original(coefficients, protos, BOXES, plan.ratio_pad, (64, 64), (240, 300),
                                    chunk_pixels=1000)
    assert all(torch.equal(a, b) for a, b in zip(banded.crops, crops.crops, strict=True))
    assert torch.equal(masks_in_original(coefficients, protos, BOXES, plan.ratio_pad, (64, 64), (240, 300)), whole)
    assert crops.windows.tolist()[2:] == [[290, 5, 300, 20], [50, 50, 50, 80], [0, 200, 40, 240]]
    picked = crops[torch.tensor([True, False, True, False, True])]
    assert torch.equal(picked.dense((240, 300)), whole[[0, 2, 4]])
    compact = CroppedMasks.from_windows(crops.windows.numpy(), [c.numpy() for c in crops.crops])
    from_whole = CroppedMasks.from_masks(whole.numpy())
    assert np.array_equal(compact.bounds, from_whole.bounds) and np.array_equal(compact.area, from_whole.area)
    assert all(np.array_equal(a, b) for a, b in zip(compact.crops, from_whole.crops, strict=True))
    assert crops.to("cpu") is crops


@pytest.mark.gpu
def test_mask_crops_on_cuda_are_the_cpu_crops_and_come_back_in_one_copy():
    """The masks sampled on CUDA (validation's path there) are the CPU's but for rounding at a logit of 0, and
    ``MaskCrops.to`` brings them back intact."""
    from yolokit.ops.masks import mask_crops_in_original

    coefficients, protos = head_output(seed=2)
    plan = letterbox_plan((240, 300), 64)
    cpu = mask_crops_in_original(coefficients, protos, BOXES, plan.ratio_pad, (64, 64), (240, 300))
    cuda = mask_crops_in_original(coefficients.cuda(), protos.cuda(), BOXES.cuda(), plan.ratio_pad, (64, 64),
                                  (240, 300))
    assert all(c.is_cuda for c in cuda.crops) and cuda.to("cuda:0") is cuda
    back = cuda.to("cpu")
    assert all(not c.is_cuda for c in back.crops)
    assert torch.equal(back.windows, cpu.windows)
    assert sum(int((a != b).sum()) for a, b in zip(back.crops, cpu.crops, strict=True)) <= 2
