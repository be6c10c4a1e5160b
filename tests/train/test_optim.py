import copy

import pytest
import torch

import yolokit
from yolokit.train.optim import (
    LRSchedule,
    build_optimizer,
    load_optimizer_state,
    parameter_groups,
    resolve_bias_lr,
    resolve_optimizer,
)


def test_groups_split_weights_norms_and_biases():
    model = yolokit.create_model("yolov8n", num_classes=2)
    decay, norm, bias = parameter_groups(model, 5e-4)

    def ids(g):
        return {id(p) for p in g["params"]}

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



def test_the_bias_warmup_rate_is_the_given_one_else_point_one_for_every_model():
    assert resolve_bias_lr(None) == 0.1                # every model, YOLO26 too (the reference's auto: 0)
    assert resolve_bias_lr(0.05) == 0.05               # a value given wins
    assert resolve_bias_lr(0.0) == 0.0


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
    short = LRSchedule(lr0=0.01, lrf=0.01, epochs=25, iters_per_epoch=25, warmup_epochs=1)
    assert short.warmup_iters == 100                                   # the floor: 4 epochs of 25 steps
    assert LRSchedule(lr0=0.01, lrf=0.01, epochs=25, iters_per_epoch=25, warmup_epochs=1,
                      warmup_min_iters=0).warmup_iters == 25            # warmup_epochs alone
    cos = LRSchedule(lr0=0.01, lrf=0.01, epochs=10, iters_per_epoch=50, cosine=True)
    assert cos.factor(5) == pytest.approx(0.505) and cos.factor(10) == pytest.approx(0.01)


def _steps(optimizer: torch.optim.Optimizer, model: torch.nn.Module, steps: int = 3) -> list[torch.Tensor]:
    """``steps`` optimizer steps on fixed random gradients, warmup-style momentum changes between them."""
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        for group in optimizer.param_groups:
            group["lr"] *= 0.9
            if "momentum" in group:
                group["momentum"] = 0.8 + 0.05 * step
            else:
                group["betas"] = (0.8 + 0.05 * step, group["betas"][1])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_optimizer_is_fused_on_the_cpu_and_matches_the_per_parameter_loop(name):
    torch.manual_seed(0)
    model = yolokit.create_model("yolov8n", num_classes=2)
    lr = 0.01 if name == "sgd" else 0.001
    results = {}
    for impl, kwargs in (("default", {}), ("foreach", {"fused": False})):
        net = copy.deepcopy(model)
        opt = build_optimizer(net, name, lr, 0.9, 5e-4, **kwargs)
        assert opt.defaults["fused" if impl == "default" else "foreach"] is True
        results[impl] = (_steps(opt, net), opt.state_dict())
    loop_net = copy.deepcopy(model)
    groups = parameter_groups(loop_net, 5e-4)
    loop = (torch.optim.SGD(groups, lr=lr, momentum=0.9, nesterov=True, foreach=False) if name == "sgd"
            else torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), foreach=False))
    expected = _steps(loop, loop_net)
    for impl, (params, state) in results.items():
        assert state["state"].keys() == loop.state_dict()["state"].keys()
        for a, b in zip(params, expected, strict=True):
            if name == "sgd" or impl == "foreach":
                assert torch.equal(a, b), impl  # same arithmetic, bit for bit
            else:  # fused AdamW rounds differently: a few float32 ulps of the parameter, or of the
                ulp = torch.finfo(torch.float32).eps   # step (about lr) where the parameter is near zero
                torch.testing.assert_close(a, b, rtol=8 * ulp, atol=8 * ulp * lr)
    moved = max((a - b).abs().max().item() for a, b in zip(expected, model.parameters(), strict=True))
    assert moved > 1e-3  # the steps did something


def test_optimizer_state_loads_across_implementations():
    """A checkpoint of the per-parameter loop resumes in the fused optimizer, which stays fused."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, bias=False), torch.nn.BatchNorm2d(4))  # no conv bias
    for name in ("sgd", "adamw"):
        a, b = copy.deepcopy(model), copy.deepcopy(model)
        groups = parameter_groups(a, 5e-4)
        loop = (torch.optim.SGD(groups, lr=0.01, momentum=0.9, nesterov=True) if name == "sgd"
                else torch.optim.AdamW(groups, lr=0.001))
        _steps(loop, a, 2)
        fused = build_optimizer(b, name, 0.5, 0.5, 0.0)  # hyperparameters come from the checkpoint
        b.load_state_dict(a.state_dict())
        plain = copy.deepcopy(fused)
        plain.load_state_dict(copy.deepcopy(loop.state_dict()))
        assert plain.param_groups[0]["fused"] is None  # what a plain load does
        load_optimizer_state(fused, copy.deepcopy(loop.state_dict()))
        assert all(g["fused"] is True and g["lr"] == loop.param_groups[0]["lr"] for g in fused.param_groups)
        for x, y in zip(_steps(fused, b, 2), _steps(loop, a, 2), strict=True):
            if name == "sgd":
                assert torch.equal(x, y)
            else:
                torch.testing.assert_close(x, y, rtol=0, atol=1e-7)
