"""Tests of tests/_host_sync.py: what counts as a host read, and what does not."""

from __future__ import annotations

import torch
from _host_sync import count_host_syncs  # tests/ is put on sys.path by tests/losses/conftest.py


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
                     "numpy": 1}


def test_plain_tensor_work_is_not_counted():
    x, idx = torch.rand(4, 5, requires_grad=True), torch.tensor([0, 2])
    mask = x.detach() > 0.5
    with count_host_syncs() as syncs:
        y = (x * 2 + 1).sigmoid()[idx].sum(0)  # arithmetic, integer indexing, reductions
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
