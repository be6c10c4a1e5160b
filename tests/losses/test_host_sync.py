"""Tests of tests/_host_sync.py: what counts as a host read, and what does not."""

from __future__ import annotations

import numpy as np
import torch
from _host_sync import count_host_syncs  # tests/ is put on sys.path by tests/losses/conftest.py

from yolokit.ops.pick import pick


def test_counts_reads_and_data_dependent_shapes():
    x = torch.arange(6.0)
    mask = x > 2
    with count_host_syncs() as syncs:
        float(x[0])
        x.sum().item()
        bool(mask.any())
        x.nonzero()
        torch.where(mask)  # one-argument where is nonzero
        x[mask]
        y = x.clone()
        y[mask] = torch.tensor(0.0)
        x.masked_select(mask)
        torch.unique(x)
        torch.bincount(x.long())
        torch.arange(3).repeat_interleave(torch.tensor([1, 2, 1]))
        x.tolist()
        x.numpy()
    assert syncs == {"_local_scalar_dense": 3, "nonzero": 2, "index (bool mask)": 1, "index_put (bool mask)": 1,
                     "masked_select": 1, "_unique2": 1, "bincount": 1, "repeat_interleave": 1, "tolist": 1,
                     "numpy": 1, "host data into the step": 2}   # y[mask] = torch.tensor(0.0), the repeats


def test_counts_the_device_waiting_for_the_host():
    """What makes CUDA wait for the host: an accumulating index_put (the backward of x[i, j]), a Python
    value written through index tensors, and host data made into a tensor inside the block."""
    x, i, j = torch.rand(4, 5, requires_grad=True), torch.tensor([0, 2, 2]), torch.tensor([1, 3, 3])
    flags, table = torch.zeros(4, 5, dtype=torch.bool), np.arange(3.0)
    with count_host_syncs() as syncs:
        x[i, j].sum().backward()                               # index's backward: index_put(accumulate=True)
        torch.zeros(4, 5).index_put_((i, j), torch.ones(3), accumulate=True)
        flags[i, j] = True                                     # True becomes a host tensor, copied
        flags[i, j] = torch.tensor([True, False, True])        # host data made into a tensor, then written
        torch.tensor([1.0, 2.0]) * 2                            # host data into the block
        torch.from_numpy(table) + 1
        torch.as_tensor([[1, 2]]).sum()
    assert syncs == {"index_put (accumulate)": 2, "host value written by indexing": 1, "host data into the step": 4}
    assert any(line.startswith("index_put (accumulate) in IndexBackward0") for line in syncs.details)


def test_a_backward_that_reads_back_is_seen():
    """prod's backward looks for zeros in its input with nonzero (on plain tensors: a dispatch mode would
    send autograd down the formula for subclasses, which does not), and the count says which backward."""
    x = torch.rand(6, 2, requires_grad=True)
    with count_host_syncs() as syncs:
        x.prod(-1).sum().backward()
    assert sum(syncs.values()) >= 1, syncs.details
    assert all("ProdBackward" in line for line in syncs.details), syncs.details


def test_a_slice_fill_and_host_data_made_before_are_not_counted():
    x, kept = torch.zeros(4, 5), torch.tensor([1.0, 2.0])      # made outside the block: nothing crosses in it
    with count_host_syncs() as syncs:
        x[:, 0] = 1.0                                          # a fill with the value read on the host
        x[1] = 2
        x[:2, :2] = kept[:, None]
    assert not syncs, dict(syncs)


def test_plain_tensor_work_is_not_counted():
    x, idx = torch.rand(4, 5, requires_grad=True), torch.tensor([0, 2])
    mask = x.detach() > 0.5
    with count_host_syncs() as syncs:
        y = pick((x * 2 + 1).sigmoid(), idx).sum(0)  # arithmetic, integer indexing (pick's backward), reductions
        x.detach()[idx, 1:]                          # integer indexing without a backward
        z = torch.where(mask, x, 0.0).masked_fill(~mask, -1.0).topk(2, dim=1).values
        index = idx.expand(4, 2)
        w = x.gather(1, index) + torch.zeros(4, 5).scatter_reduce(1, index, x[:, :2], "amax")[:, :2]
        torch.arange(3).repeat_interleave(2)  # repeats known from Python: a fixed size
        (y.sum() + z.sum() + w.sum()).backward()
    assert not syncs, dict(syncs)


def test_tolist_and_numpy_are_restored():
    with count_host_syncs():
        pass
    assert "tolist" not in vars(torch.Tensor) and "numpy" not in vars(torch.Tensor)
    with count_host_syncs() as syncs:
        torch.ones(2).tolist()
    torch.ones(2).tolist()  # outside the block: not counted
    assert syncs == {"tolist": 1}
