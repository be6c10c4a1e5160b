"""Out of memory mid-run in one process: the step replayed at a finer split, the step retry, what counts.

run_batch is what the trainer's step runs for every loader batch.
"""

import pytest
import torch
from torch import nn

from yolokit.accel import oom
from yolokit.accel.accumulation import Accumulator
from yolokit.accel.amp import Precision
from yolokit.accel.oom import is_oom_error, retry_step, run_batch


@pytest.fixture(autouse=True)
def no_gc(monkeypatch):
    """free_memory() runs gc.collect(), slow in a test process; count the calls instead."""
    calls = []
    monkeypatch.setattr(oom, "free_memory", lambda: calls.append(1))
    return calls


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 2))


def _data(n=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 6, 6, generator=g), torch.randn(n, 2, generator=g)


def _train(batches, accumulate, *, fail=None):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    acc = Accumulator(model, accumulate=accumulate)
    calls, stepped = [], []

    def forward_backward(micro):
        x, y = micro
        (nn.functional.mse_loss(model(x), y) * len(x) / 16).backward()   # partly accumulated ...
        calls.append(len(x))
        if fail is not None and fail(x, len(calls)):
            raise torch.OutOfMemoryError("injected")                # ... when the "OOM" hits
        return len(x)

    acc.start_epoch(len(batches))
    for i, batch in enumerate(batches):
        assert sum(run_batch(acc, batch, forward_backward)) == len(batch[0])
        if acc.step_due():
            acc.sync()
            opt.step()
            opt.zero_grad(set_to_none=True)
            stepped.append(i)
    return model, acc, stepped, calls


def test_oom_mid_step_replays_the_step_at_a_finer_split():
    x, y = _data(32)
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)]
    ref, _, _, _ = _train(batches, 2)

    # the second batch of the first step fails after its backward; the first batch is run again
    def fail(xb, n):
        return n == 2 and len(xb) > 4

    with pytest.warns(RuntimeWarning, match="running the step's 2 loader batch"):
        model, acc, stepped, calls = _train(batches, 2, fail=fail)
    assert acc.splits == 2 and acc.recoveries == 1 and stepped == [1, 3]
    assert calls == [8, 8, 4, 4, 4, 4, 4, 4, 4, 4]     # fail; replay batch 0 and 1 as halves; batches 2, 3
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert acc.state_dict() == {"splits": 2, "recoveries": 1}


def test_gives_up_below_the_minimum_and_treats_cublas_failures_as_oom():
    acc = Accumulator(nn.Linear(2, 1), accumulate=1, min_micro_batch=2)

    def always(micro):
        raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)")

    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="CUBLAS_STATUS_ALLOC_FAILED"):
        run_batch(acc, torch.randn(8, 2), always)
    assert acc.splits == 4  # 8 -> 4 -> 2 images, then it stops

    def other(micro):
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        run_batch(Accumulator(nn.Linear(2, 1), accumulate=1), torch.randn(8, 2), other)
    assert is_oom_error(RuntimeError("NCCL error: Cuda failure 'out of memory'"))
    assert not is_oom_error(RuntimeError("CUDA error: an illegal memory access was encountered"))


def _stepped_params(inject, optimizer="adamw", precision="fp32"):
    model = _net()
    opt = (torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True) if optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01, foreach=True))
    prec = Precision(precision, "cpu")
    acc = Accumulator(model, accumulate=1)
    x, y = _data(16)
    hook = opt.register_step_pre_hook(inject) if callable(inject) else None
    for i in (0, 8):
        prec.backward(nn.functional.mse_loss(model(x[i:i + 8]), y[i:i + 8]) * 8)
        acc.ran(x[i:i + 8])
        assert acc.step_due()
        acc.sync()
        prec.unscale_(opt)
        norm = prec.clip_grad_norm_(opt, 10.0)
        retry_step(acc, prec.step, opt, norm)
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
    assert failed and acc.recoveries == acc.step_retries == 1 and all(g["foreach"] is False for g in opt.param_groups)
    for a, b in zip(ref, params, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-7)


def test_oom_after_an_adam_step_began_is_not_retried():
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    acc = Accumulator(model, accumulate=1)
    x, y = _data(8)
    (nn.functional.mse_loss(model(x), y) * 8).backward()

    def step_then_oom(optimizer):
        optimizer.step()                             # counters and moments updated ...
        raise torch.OutOfMemoryError("injected")     # ... then the allocation fails

    with pytest.raises(RuntimeError, match="cannot be retried exactly"):
        retry_step(acc, step_then_oom, opt)
    assert acc.step_retries == 0
