"""MuSGD against Ultralytics' own steps and groups (fixtures/musgd-reference.pt, written by
fixtures/make_musgd.py under an environment with ultralytics; nothing here imports it)."""

from __future__ import annotations

import copy
import io
from pathlib import Path

import pytest
import torch
from torch import nn

import yolokit
from yolokit.accel import MuSGD, musgd_param_groups
from yolokit.accel.musgd import muon_directions, ns_dtype, orthogonalize
from yolokit.interop.ultralytics import yolokit_name
from yolokit.train.config import TrainConfig
from yolokit.train.optim import LRSchedule, build_optimizer, load_optimizer_state, resolve_optimizer

REFERENCE = torch.load(Path(__file__).with_name("fixtures") / "musgd-reference.pt", weights_only=True)
# their name prefix -> ours, for the tiny module (the same layers in both layouts)
PREFIXES = {"model.0.": "backbone.0.", "model.1.": "backbone.1.", "model.2.cv2.": "head.box.",
            "model.2.cv3.": "head.cls.", "model.2.one2one_cv2.": "head.one2one_box.",
            "model.2.one2one_cv3.": "head.one2one_cls."}
KINDS = {"muon": "muon", "weight": "weights", "bn": "norm", "bias": "bias"}   # their group names -> ours


class Block0(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv_a = nn.Conv2d(1, 8, 3, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.conv_b = nn.Conv2d(1, 32, 3)
        self.conv_c = nn.Conv2d(1, 1, 3, bias=False)


class Block1(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 20)
        self.fc2 = nn.Linear(10, 4, bias=False)
        self.gain = nn.Parameter(torch.ones(4))
        self.cl = nn.Conv2d(2, 3, 3)


def _branch(c_out: int) -> nn.ModuleList:
    return nn.ModuleList([nn.Sequential(nn.Conv2d(2, c_out, 3, bias=False), nn.BatchNorm2d(c_out),
                                        nn.Conv2d(c_out, 3, 1))])


class Head(nn.Module):
    end_to_end = True

    def __init__(self):
        super().__init__()
        self.box, self.cls = _branch(8), _branch(4)
        self.one2one_box, self.one2one_cls = _branch(8), _branch(4)


class Tiny(nn.Module):
    """make_musgd.py's module in yolokit's layout: backbone.<i>, head.box / cls / one2one_box / one2one_cls."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.ModuleList([Block0(), Block1()])
        self.head = Head()


def ours(name: str) -> str:
    return next(new + name[len(old):] for old, new in PREFIXES.items() if name.startswith(old))


def _layout(name: str, t: torch.Tensor, channels_last: list[str]) -> torch.Tensor:
    fmt = torch.channels_last if name in {ours(n) for n in channels_last} else torch.contiguous_format
    return t.clone().contiguous(memory_format=fmt)


def reference_model(ref: dict) -> Tiny:
    model = Tiny()
    params = dict(model.named_parameters())
    assert set(params) == {ours(n) for n in ref["initial"]}
    for name, value in ref["initial"].items():
        params[ours(name)].data = _layout(ours(name), value, ref["channels_last"])
    return model


def set_grads(model: nn.Module, grads: dict, channels_last: list[str]) -> None:
    params = dict(model.named_parameters())
    for name, g in grads.items():
        params[ours(name)].grad = _layout(ours(name), g, channels_last)


def group_names(model: nn.Module, groups: list[dict]) -> dict[tuple[str, float], set[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {(g["name"], g["lr_scale"]): {names[id(p)] for p in g["params"]} for g in groups}


def max_relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs() / b.abs().clamp_min(1e-30)).max().item()


def two_steps(optimizer, model, ref):
    """The fixture's two steps, a warmup-style change of lr and momentum between them; yields after each."""
    for step in range(2):
        if step == 1:
            for g in optimizer.param_groups:
                g["lr"] *= ref["step2_lr_factor"]
                g["momentum"] = ref["step2_momentum"]
        set_grads(model, ref["grads"][step], ref["channels_last"])
        optimizer.step()
        yield step


def test_two_steps_equal_ultralytics_musgd():
    """With the reference's bfloat16 Newton-Schulz (``ns_precision="bfloat16"``): its steps."""
    ref = REFERENCE["steps"]
    model = reference_model(ref)
    groups = musgd_param_groups(model, ref["lr"], ref["momentum"], ref["weight_decay"])
    # their groups, by name: kind, lr (3x on the class branches), decay, Muon flag, Nesterov
    theirs = {(KINDS[g["param_group"]], g["lr"] / ref["lr"]): (g, {ours(n) for n in g["names"]})
              for g in ref["groups"] if g["names"]}
    assert group_names(model, groups) == {k: names for k, (_, names) in theirs.items()}
    for g in groups:
        t, _ = theirs[g["name"], g["lr_scale"]]
        assert (g["lr"], g["weight_decay"], g["use_muon"], g["momentum"], g["nesterov"]) == (
            t["lr"], t["weight_decay"], t["use_muon"], t["momentum"], t["nesterov"])
    optimizer = MuSGD(groups, ns_precision="bfloat16")
    assert (optimizer.defaults["muon_scale"], optimizer.defaults["sgd_scale"]) == (ref["muon"], ref["sgd"])
    params = dict(model.named_parameters())
    worst, before = 0.0, ref["initial"]
    for step in two_steps(optimizer, model, ref):
        for name, expected in ref["after"][step].items():
            assert not torch.equal(expected, before[name])   # every parameter moved
            got = params[ours(name)].detach()
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=0, msg=f"step {step + 1}: {name}")
            worst = max(worst, max_relative(got, expected))
        before = ref["after"][step]
    assert worst < 1e-6   # bit for bit (0.0) on the CPU that wrote the fixture
    for name, state in ref["state"].items():
        if "momentum_buffer_SGD" in state:   # a Muon parameter: their momentum_buffer is Muon's
            expected = {"muon_momentum_buffer": state["momentum_buffer"],
                        "momentum_buffer": state["momentum_buffer_SGD"]}
        else:
            expected = {"momentum_buffer": state["momentum_buffer"]}
        mine = optimizer.state[params[ours(name)]]
        assert mine.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(mine[key], value, rtol=1e-6, atol=0)


def test_yolov8n_groups_follow_their_rule_and_only_the_class_branches_get_3x():
    ref = REFERENCE["yolov8n"]
    model = yolokit.create_model("yolov8n", num_classes=3)
    groups = musgd_param_groups(model, 0.01, 0.9, 5e-4)
    mine = group_names(model, groups)
    frozen = {yolokit_name(n) for n in ref["frozen"]}   # the DFL projection: they list it, we leave it out
    theirs = {}
    for g in ref["groups"]:
        names = {yolokit_name(n) for n in g["names"]} - frozen
        if names:
            theirs[KINDS[g["param_group"]], g["lr"] / 0.01] = names
    assert mine == theirs
    assert frozen == {"head.dfl.conv.weight"}
    counts = {key: len(v) for key, v in mine.items()}
    assert counts == {("muon", 1.0): 54, ("norm", 1.0): 51, ("bias", 1.0): 54,
                      ("muon", 3.0): 9, ("norm", 3.0): 6, ("bias", 3.0): 9}
    boosted = set().union(*(v for (_, scale), v in mine.items() if scale == 3.0))
    assert boosted == {n for n, p in model.named_parameters() if n.startswith("head.cls.")}
    assert all(g["lr"] == pytest.approx(0.01 * g["lr_scale"]) for g in groups)
    assert sum(len(g["params"]) for g in groups) == sum(p.requires_grad for p in model.parameters())
    wrapped = musgd_param_groups(nn.DataParallel(model), 0.01, 0.9, 5e-4)   # names are the model's own
    assert [[id(p) for p in g["params"]] for g in wrapped] == [[id(p) for p in g["params"]] for g in groups]


def test_auto_picks_musgd_where_ultralytics_does_for_end_to_end_models_only():
    picks = REFERENCE["auto"]
    assert picks[10_001]["optimizer"] == "MuSGD" and picks[10_000]["optimizer"] == "AdamW"
    for iterations, pick in picks.items():
        name, lr, momentum = resolve_optimizer("auto", 0.01, 0.937, num_classes=4, iterations=iterations,
                                               end_to_end=True)
        assert (name, lr, momentum) == (pick["optimizer"].lower(), pick["lr"], pick["momentum"])
    # YOLOv8-style heads keep today's rule (Ultralytics 8.4 would give them MuSGD too)
    assert resolve_optimizer("auto", 0.01, 0.937, num_classes=4, iterations=10_001) == ("sgd", 0.01, 0.9)
    assert resolve_optimizer("auto", 0.01, 0.937, num_classes=4, iterations=10_000) == ("adamw", 0.00125, 0.9)
    assert resolve_optimizer("MuSGD", 0.02, 0.9, num_classes=4, iterations=1) == ("musgd", 0.02, 0.9)
    assert TrainConfig(optimizer="MuSGD").optimizer == "MuSGD"
    with pytest.raises(ValueError, match="MuSGD"):
        TrainConfig(optimizer="lion")


def test_the_trainers_musgd_and_its_schedule_keep_the_3x():
    model = Tiny()
    optimizer = build_optimizer(model, "musgd", 0.01, 0.9, 5e-4, fused=True)
    assert isinstance(optimizer, MuSGD)
    assert group_names(model, optimizer.param_groups) == group_names(model, musgd_param_groups(model, 0.01, 0.9,
                                                                                               5e-4))
    schedule = LRSchedule(lr0=0.01, lrf=0.01, epochs=10, iters_per_epoch=50, warmup_epochs=3)
    schedule.apply(optimizer, epoch=0, iteration=0)
    assert {g["lr"] for g in optimizer.param_groups if g["name"] == "bias"} == {0.1}
    assert {g["lr"] for g in optimizer.param_groups if g["name"] != "bias"} == {0.0}
    schedule.apply(optimizer, epoch=9, iteration=500)
    for g in optimizer.param_groups:
        assert g["lr"] == pytest.approx(0.01 * g["lr_scale"] * schedule.factor(9))
    assert {g["lr_scale"] for g in optimizer.param_groups} == {1.0, 3.0}


def _tiny_with_grads(seed: int) -> Tiny:
    torch.manual_seed(seed)
    model = Tiny()
    model.backbone[1].cl.to(memory_format=torch.channels_last)
    return model


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).contiguous(memory_format=torch.channels_last if p.ndim == 4
                                                               else torch.contiguous_format)
    for group in optimizer.param_groups:
        group["momentum"] = 0.8 + 0.05 * step
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_state_dict_resumes_bit_for_bit():
    model = _tiny_with_grads(0)
    optimizer = MuSGD(musgd_param_groups(model, 0.05, 0.9, 5e-4))
    for step in range(2):
        _step(model, optimizer, step)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    _step(model, optimizer, 2)

    for relayout in (False, True):
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
        if relayout:   # buffers that lost their layout are put back in the parameter's
            for state in saved["optimizer"]["state"].values():
                for key, value in state.items():
                    state[key] = value.contiguous()
        resumed = _tiny_with_grads(1)
        resumed.load_state_dict(saved["model"])
        fresh = build_optimizer(resumed, "musgd", 0.5, 0.5, 0.0)   # hyperparameters come from the checkpoint
        load_optimizer_state(fresh, saved["optimizer"])
        assert "fused" not in fresh.param_groups[0] and len(fresh.state) == len(optimizer.state)
        _step(resumed, fresh, 2)
        for a, b in zip(resumed.parameters(), model.parameters(), strict=True):
            assert torch.equal(a, b)
        for p, q in zip(resumed.parameters(), model.parameters(), strict=True):
            for key, value in optimizer.state[q].items():
                assert torch.equal(fresh.state[p][key], value) and fresh.state[p][key].stride() == value.stride()


def test_a_plain_loop_lowers_a_loss():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU(), nn.Conv2d(8, 1, 1))
    optimizer = MuSGD(musgd_param_groups(net, 0.02, 0.9, 5e-4))
    x = torch.randn(4, 3, 8, 8)
    y = x.mean(1, keepdim=True)
    losses = []
    for _ in range(4):
        loss = nn.functional.mse_loss(net(x), y)
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert losses[3] < losses[2] < losses[1] < losses[0]


def test_orthogonalize_and_the_padded_batches():
    g = torch.Generator().manual_seed(0)
    m = torch.randn(16, 40, generator=g)
    x = orthogonalize(m).float()
    assert x.dtype == torch.float32 and x.shape == m.shape
    s = torch.linalg.svdvals(x)
    assert s.min() > 0.6 and s.max() < 1.25   # the quintic's band, not exactly 1
    assert torch.equal(orthogonalize(m.T), orthogonalize(m).T)   # the wide side either way
    # a short conv weight batched with a tall one runs transposed: close, not bit for bit
    short, tall = torch.randn(4, 1, 3, 3, generator=g), torch.randn(32, 1, 3, 3, generator=g)
    alone = muon_directions([short])[0]
    together = muon_directions([short, tall])[0]
    assert not torch.equal(together, alone)
    assert (together - alone).abs().max() < 0.1 * alone.abs().max()
    assert torch.equal(muon_directions([tall, short])[1], together)   # the batch, not the order, decides
    assert muon_directions([torch.zeros(3, 5)])[0].abs().max() == 0
    with pytest.raises(ValueError, match="fewer than 2 dimensions"):
        MuSGD([{"params": [nn.Parameter(torch.ones(3))], "use_muon": True}])


def test_muon_groups_are_not_touched_until_every_direction_is_computed(monkeypatch):
    """Out of memory in Newton-Schulz leaves parameters and state as they were (a retry is exact)."""
    model = _tiny_with_grads(0)
    optimizer = MuSGD(musgd_param_groups(model, 0.05, 0.9, 5e-4))
    _step(model, optimizer, 0)
    before = copy.deepcopy((list(model.parameters()), optimizer.state_dict()))
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("test")
        return orthogonalize(*args, **kwargs)

    monkeypatch.setattr("yolokit.accel.musgd.orthogonalize", failing)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(torch.OutOfMemoryError):
        optimizer.step()
    for a, b in zip(model.parameters(), before[0], strict=True):
        assert torch.equal(a, b)
    state = optimizer.state_dict()["state"]
    assert all(torch.equal(v, before[1]["state"][i][k]) for i, s in state.items() for k, v in s.items())


def test_the_cpu_default_runs_newton_schulz_in_float32_close_to_the_reference():
    """The one deliberate deviation: "auto" is bfloat16 on CUDA only (bfloat16 products are ~8x slower
    than float32 on an AVX2 CPU); on the CPU two steps land within 3e-4 of the reference's."""
    assert ns_dtype("auto", torch.device("cuda")) == torch.bfloat16 == ns_dtype("bfloat16", torch.device("cpu"))
    assert ns_dtype("auto", torch.device("cpu")) == torch.float32
    with pytest.raises(ValueError, match="ns_precision must be one of"):
        MuSGD([torch.zeros(2, 2, requires_grad=True)], ns_precision="fp8")
    ref = REFERENCE["steps"]
    model = reference_model(ref)
    optimizer = MuSGD(musgd_param_groups(model, ref["lr"], ref["momentum"], ref["weight_decay"]))
    assert optimizer.defaults["ns_precision"] == "auto"
    params, worst = dict(model.named_parameters()), 0.0
    for step in two_steps(optimizer, model, ref):
        for name, expected in ref["after"][step].items():
            worst = max(worst, (params[ours(name)].detach() - expected).abs().max().item())
    assert 0 < worst < 3e-4


def test_found_inf_skips_on_the_device_and_a_kept_step_is_the_plain_one():
    """As torch's fused optimizers: ``found_inf`` set (what ``Precision.step`` and the fp16 scaler
    pass, so that nothing is read back on CUDA) skips the step without a host decision; zero gives
    the plain step bit for bit; ``grad_scale`` divides the gradients first."""
    from yolokit.accel.amp import Precision

    def run(flags, scale=1.0, seeds=None):
        model = _tiny_with_grads(0)
        optimizer = MuSGD(musgd_param_groups(model, 0.05, 0.9, 5e-4))
        for flag, seed in zip(flags, seeds or range(100, 100 + len(flags)), strict=True):
            g = torch.Generator().manual_seed(seed)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g) * scale
                if flag == "nan":
                    p.grad.view(-1)[0] = float("nan")
            if flag is None:
                optimizer.step()
            else:
                optimizer.grad_scale = None if scale == 1.0 else torch.tensor(scale)
                optimizer.found_inf = torch.tensor(float(flag == "nan"))
                optimizer.step()
                del optimizer.grad_scale, optimizer.found_inf
        return model, optimizer

    def state(model, optimizer):
        return [*model.parameters(), *(t for s in optimizer.state.values() for t in s.values())]

    plain = state(*run([None, None]))
    assert all(torch.equal(a, b) for a, b in zip(state(*run([0, 0])), plain, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(state(*run([0, 0], scale=1024.0)), plain, strict=True))
    # a first step skipped (its buffers left as zeros), then a kept one: the kept step alone, bit for bit
    alone = state(*run([None], seeds=[101]))
    after_skip = state(*run(["nan", 0], seeds=[100, 101]))
    assert all(torch.equal(a, b) for a, b in zip(after_skip, alone, strict=True))
    # a skipped step between kept ones changes nothing: the steps before it and after it alone
    assert all(torch.equal(a, b) for a, b in zip(state(*run([None, "nan", None], seeds=[100, 7, 101])), plain,
                                                 strict=True))
    model, optimizer = run([None])
    before = [t.clone() for t in state(model, optimizer)]
    g = torch.Generator().manual_seed(7)
    for p in model.parameters():
        p.grad = torch.full_like(p, float("inf")) if p.ndim == 4 else torch.randn(p.shape, generator=g)
    amp = Precision("fp32", "cpu")
    stepped = amp.step(optimizer, clip_grad_norm=10.0, blocking=False)
    assert not bool(stepped)
    assert all(torch.equal(a, b) for a, b in zip(state(model, optimizer), before, strict=True))
