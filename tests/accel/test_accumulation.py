"""Accumulator in one process: when a step is due, uneven epochs, the sync, no copies.

Out of memory (split and replay, step retry) is tests/accel/test_oom.py; the multi-process
cases (uneven shards, BatchNorm statistics, OOM on one rank) run in
tests/accel/test_distributed.py over 2 gloo processes.
"""

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from yolokit.accel.accumulation import Accumulator, accumulation_steps
from yolokit.accel.distributed import wrap_ddp
from yolokit.accel.split import split_batch


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 2))


def _data(n=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 6, 6, generator=g), torch.randn(n, 2, generator=g)


def test_accumulation_steps_and_errors():
    assert [accumulation_steps(64, 16), accumulation_steps(64, 24), accumulation_steps(64, 16, 2)] == [4, 3, 2]
    assert accumulation_steps(8, 16) == 1                    # never below one batch
    with pytest.raises(ValueError, match="must be >= 1"):
        accumulation_steps(64, 0)
    with pytest.raises(ValueError, match="accumulate must be >= 1"):
        Accumulator(nn.Linear(1, 1), accumulate=0)
    acc = Accumulator(nn.Linear(1, 1), accumulate=3)
    assert (acc.rank, acc.world_size, acc.steps_left) == (0, 1, 0)


def test_a_ddp_wrapped_model_is_refused():
    class FakeDDP(torch.nn.parallel.DistributedDataParallel):   # isinstance is all the check reads
        def __init__(self, module):
            nn.Module.__init__(self)
            self.module = module

    with pytest.raises(TypeError, match="not a DDP-wrapped one"):
        Accumulator(FakeDDP(nn.Linear(1, 1)), accumulate=2)
    assert wrap_ddp(nn.Linear(1, 1)).__class__ is nn.Linear     # no process group: the model itself


def _train(batches, accumulate, *, epoch=True):
    """SGD over loader batches of (x, y) with losses weighted by images / 32; returns model, acc, step points."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    acc = Accumulator(model, accumulate=accumulate)
    stepped = []
    if epoch:
        acc.start_epoch(len(batches))
    for i, batch in enumerate(batches):
        for x, y in acc.micro_batches(batch):
            (nn.functional.mse_loss(model(x), y) * len(x) / 32).backward()
        acc.ran(batch)
        assert acc.step_due() == acc.step_due()                # a question: asking twice changes nothing
        if acc.step_due():
            acc.sync()
            opt.step()
            opt.zero_grad(set_to_none=True)
            stepped.append(i)
    while acc.step_due():
        acc.sync()
        stepped.append("after")
    return model, acc, stepped


def test_accumulated_batches_equal_one_big_batch_and_the_epoch_ends_with_a_step():
    x, y = _data(40)
    big = _net()
    opt = torch.optim.SGD(big.parameters(), lr=0.1, momentum=0.9)
    for lo, hi in ((0, 32), (32, 40)):       # 32 images per step, then the 8 left over
        (nn.functional.mse_loss(big(x[lo:hi]), y[lo:hi]) * (hi - lo) / 32).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 40, 8)]
    model, acc, stepped = _train(batches, 4)
    assert stepped == [3, 4] and not acc.held and acc.steps_left == 0   # 5 batches: a step of 4, then of 1
    for a, b in zip(big.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def test_resuming_mid_epoch_counts_only_the_steps_left():
    acc = Accumulator(nn.Linear(1, 1), accumulate=2)
    acc.start_epoch(3, epoch_steps=4, first_step=2)           # 2 steps done; 3 batches for the last 2 steps
    assert acc.steps_left == 2
    with pytest.raises(ValueError, match="need more than the epoch's 3 optimizer steps"):
        acc.start_epoch(3, epoch_steps=3, first_step=2)


def test_without_start_epoch_a_partial_step_stays_held():
    x, y = _data(40)
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 40, 8)]
    _, acc, stepped = _train(batches, 4, epoch=False)
    assert stepped == [3] and len(acc.held) == 1
    with pytest.raises(RuntimeError, match="still waiting"):
        acc.start_epoch(5)


def test_rewind_drops_the_step_in_progress_and_its_batchnorm_updates():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    acc = Accumulator(model, accumulate=2)
    acc.start_epoch(4)
    before = [t.clone() for t in model[1].buffers()]
    model(torch.randn(2, 3, 4, 4)).sum().backward()
    acc.ran(torch.zeros(2))
    assert not all(torch.equal(a, b) for a, b in zip(before, model[1].buffers(), strict=True))
    acc.rewind()
    assert all(torch.equal(a, b) for a, b in zip(before, model[1].buffers(), strict=True))
    assert not acc.held and all(p.grad is None for p in model.parameters())


class AllocationCounter(TorchDispatchMode):
    """Bytes of tensors created by aten ops while ``counting`` is on."""

    def __init__(self):
        super().__init__()
        self.counting, self.bytes = True, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.counting:
            inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                      if isinstance(a, torch.Tensor)}
            for t in out if isinstance(out, (list, tuple)) else [out]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:  # new memory
                    self.bytes += t.untyped_storage().nbytes()
        return out


def test_no_copy_of_the_gradients_while_nothing_fails():
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    acc = Accumulator(model, accumulate=4)
    x = torch.randn(32, 64)
    counter = AllocationCounter()
    with counter:
        acc.start_epoch(4)
        for i in range(4):
            batch = x[8 * i:8 * i + 8]
            counter.counting = False            # the model's own work is not the accumulator's
            for micro in acc.micro_batches(batch):
                model(micro).square().mean().backward()
            counter.counting = True
            acc.ran(batch)
        assert acc.step_due()
        acc.sync()                              # one process: nothing to sum
    assert counter.bytes == 0, counter.bytes
    with counter:                           # the counter does see a copy of the gradients
        [p.grad.clone() for p in model.parameters()]
    assert counter.bytes >= grad_bytes


def test_split_batch_follows_the_batch_contract():
    images = torch.arange(5.0).view(5, 1, 1, 1).expand(5, 3, 2, 2)
    targets = torch.tensor(
        [[0, 1, 0, 0, 1, 1], [2, 0, 0, 0, 2, 2], [3, 1, 1, 1, 2, 2], [4, 2, 0, 0, 1, 1], [4, 0, 1, 1, 3, 3]]
    )
    batch = {"images": images, "targets": targets.float(), "paths": list("abcde"), "epoch": 3}
    first, second = split_batch(batch, 2)
    assert first["images"][:, 0, 0, 0].tolist() == [0, 1, 2] and second["images"][:, 0, 0, 0].tolist() == [3, 4]
    assert first["targets"][:, 0].tolist() == [0, 2] and second["targets"][:, 0].tolist() == [0, 1, 1]
    torch.testing.assert_close(second["targets"][:, 1:], targets[2:, 1:].float())
    assert first["paths"] == ["a", "b", "c"] and second["paths"] == ["d", "e"] and second["epoch"] == 3
    assert targets[0, 0] == 0 and batch["targets"][2, 0] == 3  # input untouched
    x, y = torch.randn(4, 2), torch.randn(4)
    parts = split_batch((x, y), 8)  # capped at one image per part
    assert len(parts) == 4 and torch.equal(torch.cat([p[0] for p in parts]), x) and isinstance(parts[0], tuple)
    assert split_batch(batch, 1)[0] is batch
    uint8 = {"images_uint8": torch.zeros(6, 3, 2, 2, dtype=torch.uint8), "targets": torch.zeros(0, 6)}
    assert [len(p["images_uint8"]) for p in split_batch(uint8, 4)] == [2, 2, 1, 1]
