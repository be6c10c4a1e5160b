"""Tests of losses/pairwise.py: the assigner's pairwise CIoU against ops.boxes.ciou."""

import torch

from yolokit.losses.pairwise import box_terms, pairwise_ciou
from yolokit.ops.boxes import ciou


def _boxes(gen: torch.Generator, shape: tuple[int, ...], size: float) -> torch.Tensor:
    xy = torch.rand(*shape, 2, generator=gen) * 100
    return torch.cat([xy, xy + 1 + torch.rand(*shape, 2, generator=gen) * size], -1)


def test_pairwise_ciou_is_ops_ciou_bit_for_bit():
    """The pairwise CIoU repeats ``ops.boxes.ciou``'s arithmetic on per-box terms; if either changes, this fails."""
    gen = torch.Generator().manual_seed(3)
    pred, gts = _boxes(gen, (2, 50), 60), _boxes(gen, (2, 7), 80)
    pred[0, :5, 2:] = pred[0, :5, :2]  # zero-size predictions
    pairs = pairwise_ciou([t[:, None] for t in box_terms(pred)], [t[..., None] for t in box_terms(gts)])
    expected = ciou(pred[:, None].expand(2, 7, 50, 4), gts[:, :, None].expand(2, 7, 50, 4))
    assert pairs.shape == (2, 7, 50) and torch.equal(pairs, expected)


def test_box_terms_and_inputs_left_unchanged():
    """The in-place arithmetic writes only temporaries: the assigner reuses the terms chunk after chunk."""
    boxes = torch.tensor([[0.0, 0.0, 4.0, 2.0], [10.0, 10.0, 13.0, 16.0]])
    terms = box_terms(boxes)
    assert torch.equal(terms[4], torch.tensor([8.0, 18.0]))
    assert torch.allclose(terms[5], torch.atan(torch.tensor([2.0, 0.5])))
    before = [t.clone() for t in terms]
    pairs = pairwise_ciou([t[None] for t in terms], [t[:, None] for t in terms])  # [2, 2], gt x pred
    assert all(torch.equal(a, b) for a, b in zip(before, terms, strict=True))
    assert torch.allclose(pairs.diagonal(), torch.ones(2)) and (pairs[0, 1] < 0) and (pairs[1, 0] < 0)
