"""The mask term of the segmentation loss against the reference's, value and gradients, on a batch with
overlapping, tiny and thin objects and an image without any (fixtures/seg-loss.pt, written by
fixtures/make_seg_loss.py with the reference)."""

from pathlib import Path

import pytest
import torch

from yolokit.losses.masks import box_window, mask_loss, object_ranks

REFERENCE = torch.load(Path(__file__).parent / "fixtures" / "seg-loss.pt", weights_only=True)


def point_rows(fg, gt_idx, gt_image):
    """The reference's (foreground, index within the image) as each point's GT row (N at background)."""
    n, b = len(gt_image), fg.shape[0]
    counts = torch.bincount(gt_image, minlength=b)
    first = torch.cumsum(counts, 0) - counts
    return torch.where(fg, first[:, None] + gt_idx, n)


def assert_relative(ours, theirs, what, rel=1e-4):
    scale = float(theirs.abs().max())
    gap = float((ours - theirs).abs().max())
    assert gap <= rel * scale, f"{what}: differs by {gap:.3g}, {gap / scale:.2g} of its largest value"


@pytest.mark.parametrize("case", ["overlap", "per_instance", "upsampled"])
def test_the_mask_term_and_its_gradients_are_the_references(case):
    ref = REFERENCE["cases"][case]
    coefficients = REFERENCE["coefficients"].clone().requires_grad_(True)
    protos = REFERENCE["protos"].clone().requires_grad_(True)
    rows = point_rows(REFERENCE["fg"], REFERENCE["gt_idx"], REFERENCE["gt_image"])
    loss = mask_loss(coefficients, protos, rows, REFERENCE["gt_image"], REFERENCE["gt_boxes"], ref["masks"],
                     REFERENCE["imgsz"], overlap=ref["overlap"])
    loss.backward()
    assert_relative(loss.detach(), ref["loss"], "loss")
    assert_relative(coefficients.grad, ref["grad_coefficients"], "gradient of the coefficients")
    assert_relative(protos.grad, ref["grad_protos"], "gradient of the prototypes")
    assert float(coefficients.grad[2].abs().max()) == 0.0      # the image without objects trains nothing


def test_no_positive_point_gives_a_zero_that_reaches_both_inputs():
    coefficients = torch.randn(2, 4, 10, requires_grad=True)
    protos = torch.randn(2, 4, 8, 8, requires_grad=True)
    loss = mask_loss(coefficients, protos, torch.full((2, 10), 3), torch.tensor([0, 0, 1]),
                     torch.tensor([[0.0, 0.0, 8.0, 8.0]] * 3), torch.zeros(2, 8, 8), (32, 32))
    loss.backward()
    assert float(loss.detach()) == 0.0 and coefficients.grad is not None and protos.grad is not None


def test_ranks_count_each_images_rows_in_order_and_windows_cover_half_open_pixels():
    assert object_ranks(torch.tensor([1, 0, 1, 1, 0]), 2).tolist() == [0, 0, 1, 2, 1]
    cols, rows = box_window(torch.tensor([[1.0, 0.5, 3.0, 2.0]]), 3, 5)
    assert cols.flatten().tolist() == [0, 1, 1, 0, 0] and rows.flatten().tolist() == [0, 1, 0]
