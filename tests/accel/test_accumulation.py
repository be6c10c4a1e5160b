"""Accumulator: when to step, and 4 accumulated micro-batches equal one big batch."""

import pytest
import torch
from torch import nn

from yolokit.accel.accumulation import Accumulator


def test_steps_and_effective_batch():
    assert (Accumulator(64, 16).steps, Accumulator(64, 16).effective_batch) == (4, 64)
    assert Accumulator(64, 24).steps == 3  # round(2.67)
    assert Accumulator(64, 16, world_size=2).steps == 2
    assert Accumulator(8, 16).steps == 1 and Accumulator(8, 16).loss_weight == 1.0
    with pytest.raises(ValueError):
        Accumulator(64, 0)


def test_should_step_every_n_micro_steps():
    acc, model = Accumulator(32, 8), nn.Linear(1, 1)
    pattern = []
    for _ in range(8):
        last = acc.is_last
        with acc.micro_step(model):
            pass
        pattern.append((last, acc.should_step()))
    assert pattern == [(False, False), (False, False), (False, False), (True, True)] * 2
    assert acc.pending == 0
    with pytest.raises(RuntimeError), acc.micro_step(model):
        raise RuntimeError("failed micro-step")
    assert acc.pending == 0  # a failed micro-step is not counted


def test_four_micro_batches_equal_one_big_batch():
    torch.manual_seed(0)
    big = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 2))
    acc_model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 2))
    acc_model.load_state_dict(big.state_dict())
    x, y = torch.randn(32, 3, 6, 6), torch.randn(32, 2)

    opt_big = torch.optim.SGD(big.parameters(), lr=0.1)
    nn.functional.mse_loss(big(x), y).backward()
    big_grads = [p.grad.clone() for p in big.parameters()]
    opt_big.step()

    acc = Accumulator(nominal_batch=32, batch_size=8)
    opt = torch.optim.SGD(acc_model.parameters(), lr=0.1)
    steps = 0
    for i in range(4):
        with acc.micro_step(acc_model):
            loss = nn.functional.mse_loss(acc_model(x[8 * i : 8 * i + 8]), y[8 * i : 8 * i + 8])
            (loss * acc.loss_weight).backward()
        if acc.should_step():
            for g, p in zip(big_grads, acc_model.parameters(), strict=True):
                torch.testing.assert_close(p.grad, g, rtol=0, atol=1e-6)
            opt.step()
            steps += 1
    assert steps == 1
    for a, b in zip(big.parameters(), acc_model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def test_reset_drops_pending_micro_steps():
    from torch import nn

    from yolokit.accel.accumulation import Accumulator

    acc = Accumulator(64, 16)
    with acc.micro_step(nn.Linear(1, 1)):
        pass
    assert acc.pending == 1 and not acc.should_step()
    acc.reset()
    assert acc.pending == 0 and acc.is_last is False
