"""ModelEMA: the decay formula, bit-equal to a per-tensor loop, no state dict built per update."""

import copy
import math

import torch
from torch import nn

import yolokit
from yolokit.train.ema import ModelEMA


def _loop_update(ema_model: nn.Module, model: nn.Module, d: float) -> None:
    """The reference: walk both state dicts and update tensor by tensor."""
    source = model.state_dict()
    with torch.no_grad():
        for name, value in ema_model.state_dict().items():
            new = source[name].detach()
            if value.dtype.is_floating_point:
                value.mul_(d).add_(new.to(value.dtype), alpha=1 - d)
            else:
                value.copy_(new)


def _train_a_little(model: nn.Module, step: int) -> None:
    """Moves weights and BN buffers (running stats, num_batches_tracked) like a training step."""
    g = torch.Generator().manual_seed(step)
    model.train()
    out = model(torch.rand(2, 3, 64, 64, generator=g))
    sum(o.square().mean() for o in out).backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(0.05 * p.grad)
                p.grad = None


def test_decay_formula_and_state_dict_round_trip():
    model = nn.Linear(2, 1)
    ema = ModelEMA(model, decay=0.9, tau=1.0)
    start = ema.module.weight.clone()
    with torch.no_grad():
        model.weight.fill_(1.0)
    ema.update(model)
    d = 0.9 * (1 - math.exp(-1))
    torch.testing.assert_close(ema.module.weight, start * d + (1 - d) * 1.0)
    state = ema.state_dict()
    assert set(state) == {"module", "updates", "decay", "tau"} and list(state["module"]) == ["weight", "bias"]
    other = ModelEMA(nn.Linear(2, 1))
    other.load_state_dict(state)
    assert other.updates == 1 and torch.equal(other.module.weight, ema.module.weight)
    assert not any(p.requires_grad for p in ema.module.parameters())


def test_updates_are_bit_equal_to_the_state_dict_loop():
    torch.manual_seed(0)
    model = yolokit.create_model("yolov8n", num_classes=2)
    ema = ModelEMA(model, decay=0.999, tau=3.0)  # short ramp: d moves from 0.28 to 0.82 over 5 updates
    reference = copy.deepcopy(ema.module)
    for step in range(5):
        _train_a_little(model, step)
        ema.update(model)
        _loop_update(reference, model, ema.current_decay())
    state, expected = ema.module.state_dict(), reference.state_dict()
    assert list(state) == list(expected)
    for name, value in expected.items():
        assert torch.equal(state[name], value), name
    bn = ema.module.backbone.stem.bn
    assert int(bn.num_batches_tracked) == 5  # integer buffers are copied
    assert not torch.equal(bn.running_mean, torch.zeros_like(bn.running_mean))


def test_lerp_would_round_differently():
    """Why update uses mul_ + add_: the resume tests compare EMA tensors bit for bit."""
    g = torch.Generator().manual_seed(0)
    ema, new, d = [torch.randn(10_000, generator=g)], [torch.randn(10_000, generator=g)], 0.3
    by_mul_add = [e.clone() for e in ema]
    torch._foreach_mul_(by_mul_add, d)
    torch._foreach_add_(by_mul_add, new, alpha=1 - d)
    by_lerp = [e.clone() for e in ema]
    torch._foreach_lerp_(by_lerp, new, 1 - d)
    torch.testing.assert_close(by_lerp[0], by_mul_add[0])
    assert not torch.equal(by_lerp[0], by_mul_add[0])


class _Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
        self.state_dict_calls = 0

    def state_dict(self, *args, **kwargs):
        self.state_dict_calls += 1
        return super().state_dict(*args, **kwargs)


def test_no_state_dict_is_built_per_update():
    model = _Counting()
    ema = ModelEMA(model, tau=1.0)
    for _ in range(4):
        with torch.no_grad():
            model.net[0].weight.add_(1.0)
        ema.update(model)
    assert model.state_dict_calls == 1 and ema.module.state_dict_calls == 1  # pairing, once
    assert ema.updates == 4 and not torch.equal(ema.module.net[0].weight, model.net[0].weight)


def test_another_model_object_or_dtype_is_paired_again():
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    ema = ModelEMA(model, tau=1.0)
    ema.update(model)
    twin = copy.deepcopy(model).double()  # a different object, and other dtypes
    with torch.no_grad():
        twin[0].weight.fill_(2.0)
    reference = copy.deepcopy(ema.module)
    ema.update(twin)
    _loop_update(reference, twin, ema.current_decay())
    for (name, value), expected in zip(ema.module.state_dict().items(), reference.state_dict().values(), strict=True):
        assert value.dtype == expected.dtype and torch.equal(value, expected), name


def test_a_tensor_shared_under_two_names_is_updated_once():
    model = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False))
    model[1].weight = model[0].weight  # tied weights: two state-dict names, one tensor
    ema = ModelEMA(model, tau=1.0)
    assert ema.module[1].weight is ema.module[0].weight
    start = ema.module[0].weight.clone()
    with torch.no_grad():
        model[0].weight.fill_(1.0)
    ema.update(model)
    d = ema.current_decay()
    torch.testing.assert_close(ema.module[0].weight, start * d + (1 - d), rtol=0, atol=1e-7)
