"""Accumulator in one process: steps, weights, epochs, splits on OOM (with replay), step OOM, no copies.

The multi-process cases (uneven shards, BatchNorm statistics, OOM on one rank) run in
tests/accel/test_distributed.py over 2 gloo processes.
"""

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from yolokit.accel import batch_size as bs
from yolokit.accel.accumulation import Accumulator, split_batch
from yolokit.accel.amp import Precision


@pytest.fixture(autouse=True)
def no_gc(monkeypatch):
    """free_memory() runs gc.collect(), slow in a test process; count the calls instead."""
    calls = []
    monkeypatch.setattr(bs, "free_memory", lambda: calls.append(1))
    monkeypatch.setattr("yolokit.accel.accumulation.free_memory", lambda: calls.append(1))
    return calls


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 2))


def _data(n=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 6, 6, generator=g), torch.randn(n, 2, generator=g)


def test_steps_weights_and_errors():
    model = nn.Linear(1, 1)
    acc = Accumulator(model, nominal_batch=64, batch_size=16)
    assert (acc.steps, acc.effective_batch, acc.loss_weight(16), acc.loss_weight(8)) == (4, 64, 0.25, 0.125)
    assert Accumulator(model, nominal_batch=64, batch_size=24).steps == 3  # round(2.67)
    assert Accumulator(model, nominal_batch=64, batch_size=16, world_size=2).steps == 2
    summed = Accumulator(model, nominal_batch=8, batch_size=16, reduction="sum")
    assert summed.steps == 1 and summed.loss_weight(16) == 16.0 and summed.loss_weight(3) == 3.0
    with pytest.raises(ValueError, match="must be >= 1"):
        Accumulator(model, nominal_batch=64, batch_size=0)
    with pytest.raises(ValueError, match="reduction"):
        Accumulator(model, nominal_batch=64, batch_size=8, reduction="max")


def _train(acc_kwargs, batches, *, fail=None, epoch=True, step_fail=None):
    """SGD over loader batches of (x, y); returns the model, the step boundaries and fn's calls."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    acc = Accumulator(model, **acc_kwargs)
    calls, stepped = [], []

    def forward_backward(micro, weight):
        x, y = micro
        (nn.functional.mse_loss(model(x), y) * weight).backward()   # gradients partly accumulated ...
        calls.append(len(x))
        if fail is not None and fail(x, len(calls)):
            raise torch.OutOfMemoryError("injected")                # ... when the "OOM" hits
        return len(x)

    if epoch:
        acc.start_epoch(len(batches))
    for i, batch in enumerate(batches):
        acc.run(forward_backward, batch)
        if acc.should_step():
            stepped.append(i)
            acc.step(opt)
            opt.zero_grad(set_to_none=True)
    while acc.should_step():
        stepped.append("after")
        acc.step(opt)
    return model, acc, stepped, calls


def test_accumulated_micro_batches_equal_one_big_batch_and_the_epoch_ends_with_a_step():
    x, y = _data(40)
    big = _net()
    opt = torch.optim.SGD(big.parameters(), lr=0.1, momentum=0.9)
    for lo, hi in ((0, 32), (32, 40)):       # 32 images per step, then the 8 left over
        (nn.functional.mse_loss(big(x[lo:hi]), y[lo:hi]) * (hi - lo) / 32).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 40, 8)]
    model, acc, stepped, _ = _train(dict(nominal_batch=32, batch_size=8), batches)
    assert acc.steps == 4 and stepped == [3, 4] and acc.pending == 0   # 5 batches: a step of 4, then of 1
    for a, b in zip(big.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def test_without_start_epoch_a_partial_step_stays_pending():
    x, y = _data(40)
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 40, 8)]
    _, acc, stepped, _ = _train(dict(nominal_batch=32, batch_size=8), batches, epoch=False)
    assert stepped == [3] and acc.pending == 1
    with pytest.raises(RuntimeError, match="still waiting"):
        acc.start_epoch(5)


def test_oom_mid_step_replays_the_step_at_a_finer_split():
    x, y = _data(32)
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)]
    ref, _, _, _ = _train(dict(nominal_batch=16, batch_size=8), batches)

    # the second batch of the first step fails after its backward; the first batch is run again
    def fail(xb, n):
        return n == 2 and len(xb) > 4

    with pytest.warns(RuntimeWarning, match="running the step's 2 loader batch"):
        model, acc, stepped, calls = _train(dict(nominal_batch=16, batch_size=8), batches, fail=fail)
    assert acc.splits == 2 and acc.recoveries == 1 and stepped == [1, 3]
    assert calls == [8, 8, 4, 4, 4, 4, 4, 4, 4, 4]     # fail; replay batch 0 and 1 as halves; batches 2, 3
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    assert acc.state_dict() == {"splits": 2, "recoveries": 1}


def test_gives_up_below_the_minimum_and_treats_cublas_failures_as_oom():
    model = nn.Linear(2, 1)
    acc = Accumulator(model, nominal_batch=8, batch_size=8, min_micro_batch=2)

    def always(micro, weight):
        raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)")

    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="CUBLAS_STATUS_ALLOC_FAILED"):
        acc.run(always, torch.randn(8, 2))
    assert acc.splits == 4  # 8 -> 4 -> 2 images, then it stops

    def other(micro, weight):
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        Accumulator(model, nominal_batch=8, batch_size=8).run(other, torch.randn(8, 2))


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
    acc = Accumulator(model, nominal_batch=32, batch_size=8)
    x = torch.randn(32, 64)
    counter = AllocationCounter()

    def forward_backward(micro, weight):
        counter.counting = False            # the model's own work is not the accumulator's
        (model(micro).square().mean() * weight).backward()
        counter.counting = True

    with counter:
        acc.start_epoch(4)
        for i in range(4):
            acc.run(forward_backward, x[8 * i:8 * i + 8])
        assert acc.should_step()
    assert counter.bytes == 0, counter.bytes
    with counter:                           # the counter does see a copy of the gradients
        [p.grad.clone() for p in model.parameters()]
    assert counter.bytes >= grad_bytes


def _stepped_params(inject, optimizer="adamw", precision="fp32"):
    model = _net()
    opt = (torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True) if optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01, foreach=True))
    prec = Precision(precision, "cpu")
    acc = Accumulator(model, nominal_batch=8, batch_size=8)
    x, y = _data(16)
    hook = opt.register_step_pre_hook(inject) if inject == "pre" or callable(inject) else None
    for i in (0, 8):
        acc.run(lambda m, w: prec.backward(nn.functional.mse_loss(model(m[0]), m[1]) * w), (x[i:i + 8], y[i:i + 8]))
        assert acc.should_step()
        acc.step(opt, lambda: prec.step(opt, clip_grad_norm=10.0))
        opt.zero_grad(set_to_none=True)
    if hook is not None:
        hook.remove()
    return [p.detach().clone() for p in model.parameters()], opt, acc


@pytest.mark.parametrize("optimizer,precision", [("adamw", "fp32"), ("sgd", "fp32"), ("sgd", "fp16")])
def test_oom_in_optimizer_step_before_it_changes_anything_is_retried_exactly(optimizer, precision):
    ref, _, _ = _stepped_params(None, optimizer, precision)
    failed = []

    def oom_once(opt, args, kwargs):
        if not failed:
            failed.append(1)
            raise torch.OutOfMemoryError("injected at the start of optimizer.step")

    with pytest.warns(RuntimeWarning, match="foreach off"):
        params, opt, acc = _stepped_params(oom_once, optimizer, precision)
    assert failed and acc.recoveries == 1 and all(g["foreach"] is False for g in opt.param_groups)
    for a, b in zip(ref, params, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-7)


def test_oom_after_an_adam_step_began_is_not_retried():
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    acc = Accumulator(model, nominal_batch=8, batch_size=8)
    x, y = _data(8)
    acc.run(lambda m, w: (nn.functional.mse_loss(model(m[0]), m[1]) * w).backward(), (x, y))
    assert acc.should_step()

    def step_then_oom():
        opt.step()                                   # counters and moments updated ...
        raise torch.OutOfMemoryError("injected")     # ... then the allocation fails

    with pytest.raises(RuntimeError, match="cannot be retried exactly"):
        acc.step(opt, step_then_oom)


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
