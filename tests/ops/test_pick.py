"""ops.pick: advanced indexing whose backward is a scatter_add, not an accumulating index_put."""

from __future__ import annotations

import pytest
import torch

from yolokit.ops.pick import pick


def _case(gen, layout):
    x = torch.randn(3, 12, 5, 7, generator=gen)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    view = x.view(3, 3, 4, 35) if layout == "contiguous" else x.reshape(3, 3, 4, 35)   # a view either way
    return x.requires_grad_(), view


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "split"])
def test_values_and_gradients_equal_advanced_indexing(layout):
    """The values and the gradient (duplicates summed) equal ``x[i, j, :, k]``'s, on a plain view,
    a channels_last map's view and a split's non-contiguous part (how the losses see their maps)."""
    gen = torch.Generator().manual_seed(0)
    i = torch.tensor([0, 2, 2, 1, 2])
    j = torch.tensor([1, 0, 0, 2, 0])
    k = torch.tensor([3, 34, 34, 0, 7])            # rows 1 and 2 are the same elements
    weights = torch.randn(5, 4 if layout != "split" else 3, generator=gen)
    grads = []
    for use_pick in (True, False):
        x, view = _case(torch.Generator().manual_seed(1), "channels_last" if layout == "channels_last" else "x")
        if layout == "split":
            view = view.split((1, 3), dim=2)[1]    # [3, 3, 3, 35], not contiguous
        got = pick(view, i, j, None, k) if use_pick else view[i, j, :, k]
        assert got.shape == (5, view.shape[2])
        (got * weights).sum().backward()
        grads.append((got.detach(), x.grad))
    assert torch.equal(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=0, atol=0)


def test_leading_and_trailing_whole_dims():
    x = torch.arange(2 * 3 * 4 * 5.0).view(2, 3, 4, 5).requires_grad_()
    i, k = torch.tensor([1, 0, 1]), torch.tensor([4, 0, 4])
    got = pick(x, i, None, None, k)                # x[i, :, :, k]: [3, 3, 4]
    assert torch.equal(got, x[i, :, :, k])
    got.sum().backward()
    expected = torch.zeros_like(x)
    expected[1, :, :, 4], expected[0, :, :, 0] = 2.0, 1.0
    assert torch.equal(x.grad, expected)
    assert torch.equal(pick(x, i), x[i])           # dims after the last index are taken whole
    assert torch.equal(pick(x, torch.tensor([], dtype=torch.long)), x[:0])


def test_bad_indices_are_refused():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="dim 0"):
        pick(x, None, torch.tensor([0]))
    with pytest.raises(IndexError, match="3 indices"):
        pick(x, torch.tensor([0]), None, None)
    with pytest.raises(IndexError):
        pick(x, torch.tensor([2]))                 # out of range: the indexing's own error


def test_the_backward_accumulates_nothing_by_index_put():
    from _host_sync import count_host_syncs

    x, i, k = torch.randn(4, 6, 9, requires_grad=True), torch.tensor([0, 3, 3]), torch.tensor([8, 1, 1])
    with count_host_syncs() as syncs:
        pick(x, i, None, k).sum().backward()
    assert not syncs, dict(syncs)
