import math

import pytest
import torch

import yolokit
from yolokit.train.ema import ModelEMA
from yolokit.train.optim import LRSchedule, build_optimizer, parameter_groups, resolve_optimizer


def test_groups_split_weights_norms_and_biases():
    model = yolokit.create_model("yolov8n", num_classes=2)
    decay, norm, bias = parameter_groups(model, 5e-4)
    ids = lambda g: {id(p) for p in g["params"]}
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d) and m.weight.requires_grad]
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert ids(decay) == {id(c.weight) for c in convs}
    assert ids(norm) == {id(b.weight) for b in bns}
    assert ids(bias) == {id(b.bias) for b in bns} | {id(c.bias) for c in convs if c.bias is not None}
    assert decay["weight_decay"] == 5e-4 and norm["weight_decay"] == 0 and bias["weight_decay"] == 0
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert sum(p.numel() for g in (decay, norm, bias) for p in g["params"]) == total


def test_auto_optimizer_rule():
    assert resolve_optimizer("auto", 0.01, 0.937, num_classes=4, iterations=20_000) == ("sgd", 0.01, 0.9)
    assert resolve_optimizer("auto", 0.01, 0.937, num_classes=4, iterations=500) == ("adamw", 0.00125, 0.9)
    assert resolve_optimizer("SGD", 0.02, 0.9, num_classes=4, iterations=1) == ("sgd", 0.02, 0.9)
    with pytest.raises(ValueError, match="lion"):
        resolve_optimizer("lion", 0.01, 0.9, num_classes=1, iterations=1)


def test_schedule_warmup_and_decay():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4))
    opt = build_optimizer(model, "sgd", 0.01, 0.937, 5e-4)
    s = LRSchedule(lr0=0.01, lrf=0.01, epochs=10, iters_per_epoch=50, warmup_epochs=3)
    assert s.warmup_iters == 150
    s.apply(opt, epoch=0, iteration=0)
    lrs = {g["name"]: g["lr"] for g in opt.param_groups}
    assert lrs == {"weights": 0.0, "norm": 0.0, "bias": 0.1} and opt.param_groups[0]["momentum"] == 0.8
    s.apply(opt, epoch=1, iteration=75)  # halfway through warmup: halfway to the epoch-1 target
    target = 0.01 * s.factor(1)
    assert opt.param_groups[0]["lr"] == pytest.approx(target / 2)
    assert opt.param_groups[2]["lr"] == pytest.approx(0.1 + (target - 0.1) / 2)
    s.apply(opt, epoch=9, iteration=500)
    assert all(g["lr"] == pytest.approx(0.01 * (0.1 * 0.99 + 0.01)) for g in opt.param_groups)
    assert s.factor(0) == 1.0 and s.factor(10) == pytest.approx(0.01)
    cos = LRSchedule(lr0=0.01, lrf=0.01, epochs=10, iters_per_epoch=50, cosine=True)
    assert cos.factor(5) == pytest.approx(0.505) and cos.factor(10) == pytest.approx(0.01)


def test_ema_follows_the_decay_formula():
    model = torch.nn.Linear(2, 1)
    ema = ModelEMA(model, decay=0.9, tau=1.0)
    start = ema.module.weight.clone()
    with torch.no_grad():
        model.weight.fill_(1.0)
    ema.update(model)
    d = 0.9 * (1 - math.exp(-1))
    torch.testing.assert_close(ema.module.weight, start * d + (1 - d) * 1.0)
    state = ema.state_dict()
    other = ModelEMA(torch.nn.Linear(2, 1))
    other.load_state_dict(state)
    assert other.updates == 1 and torch.equal(other.module.weight, ema.module.weight)
    assert not any(p.requires_grad for p in ema.module.parameters())
