"""Precision: autocast, loss scaling, unscale / clip / guarded step, skipped-step counts, state."""

import copy
import warnings

import pytest
import torch
from _precision_error import prediction_error  # tests/accel is on the path (conftest)
from torch import nn

from yolokit.accel.amp import Precision, resolve_precision


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.SiLU(), nn.Linear(32, 1))


def _data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 8, generator=g)
    return x, (x[:, :1] * 2 - x[:, 1:2]).sin()


def test_resolve_precision():
    assert resolve_precision("auto", "cpu") == "fp32"
    assert resolve_precision("bf16", "cpu") == "bf16"
    with pytest.raises(ValueError):
        resolve_precision("fp8", "cpu")


def test_bf16_autocast_on_cpu_trains():
    model, (x, y) = _mlp(), _data()
    prec = Precision("bf16", "cpu")
    assert prec.dtype == torch.bfloat16 and prec.scaler is None and prec.scale == 1.0
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    losses = []
    for _ in range(60):
        with prec.autocast():
            out = model(x)
            loss = nn.functional.mse_loss(out.float(), y)
        assert out.dtype == torch.bfloat16  # autocast really ran the Linear layers in bf16
        prec.backward(loss)
        assert prec.step(optimizer=opt) is True
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32
    assert losses[-1] < 0.1 * losses[0]


def test_fp16_scaler_skips_inf_step_and_lowers_scale():
    model, (x, y) = _mlp(), _data()
    prec = Precision("fp16", "cpu", init_scale=1024.0, growth_interval=2)
    assert prec.scale == 1024.0
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def backward():
        with prec.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        prec.backward(loss)

    # reference fp32 gradient of the same loss under the same autocast
    ref = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.float16):
        nn.functional.mse_loss(ref(x).float(), y).backward()

    backward()
    w = model[0].weight
    torch.testing.assert_close(w.grad / 1024.0, ref[0].weight.grad, rtol=1e-3, atol=1e-6)  # backward scaled the loss
    before = [p.detach().clone() for p in model.parameters()]
    w.grad[0, 0] = float("inf")
    assert prec.step(opt) is False
    assert prec.scale == 512.0
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b)  # step skipped: no weight moved
    opt.zero_grad(set_to_none=True)

    backward()
    assert prec.step(opt) is True
    assert prec.scale == 512.0
    # the applied update used unscaled gradients: w_new = w_old - lr * g_true
    torch.testing.assert_close(before[0] - w.detach(), 0.1 * ref[0].weight.grad, rtol=2e-3, atol=1e-6)
    opt.zero_grad(set_to_none=True)
    backward()
    assert prec.step(opt) is True
    assert prec.scale == 1024.0  # growth_interval=2 finite steps in a row doubled it


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_a_skipped_first_step_of_fused_sgd_leaves_its_momentum_at_zero(precision):
    """torch's fused SGD makes its momentum buffers with empty_like on its first step and keeps them
    unwritten when that step is skipped on the device (fp16's first steps overflow): the next step
    read garbage. Precision.step gives them zeros first; the run then equals the per-parameter
    (foreach) SGD's bit for bit."""
    runs = {}
    for fused in (True, False):
        model, (x, y) = _mlp(), _data()
        prec = Precision(precision, "cpu", init_scale=1024.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True,
                              **({"fused": True} if fused else {"foreach": True}))
        garbage = [torch.full((4096,), 3e38) for _ in range(8)]   # freed memory the buffers may land in
        del garbage
        for step in range(3):
            with prec.autocast():
                loss = nn.functional.mse_loss(model(x).float(), y)
            prec.backward(loss)
            if step == 0:
                model[0].weight.grad[0, 0] = float("inf")      # the first step is skipped
            assert prec.step(opt, clip_grad_norm=10.0) is (step > 0)
            opt.zero_grad(set_to_none=True)
            if step == 0 and fused:
                assert all(torch.count_nonzero(s["momentum_buffer"]) == 0 for s in opt.state.values())
        runs[fused] = [p.detach().clone() for p in model.parameters()]
    assert all(torch.isfinite(p).all() for p in runs[True])
    assert all(torch.equal(a, b) for a, b in zip(runs[True], runs[False], strict=True))


def test_fp16_unscales_before_clipping():
    model, (x, y) = _mlp(), _data()
    ref = copy.deepcopy(model)
    nn.functional.mse_loss(ref(x), y * 50).backward()
    g = torch.cat([p.grad.flatten() for p in ref.parameters()])
    assert g.norm() > 1.0
    prec = Precision("fp16", "cpu", init_scale=256.0)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    with prec.autocast():
        loss = nn.functional.mse_loss(model(x).float(), y * 50)
    prec.backward(loss)
    assert prec.step(opt, clip_grad_norm=1.0)
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    step = before - after
    assert step.norm().item() == pytest.approx(1.0, rel=1e-3)  # clipped in true units
    assert torch.nn.functional.cosine_similarity(step, g, dim=0) > 0.999


def test_fp32_step_skips_nan_gradients():
    model, (x, y) = _mlp(), _data()
    prec = Precision("fp32", "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prec.backward(nn.functional.mse_loss(model(x), y))
    model[2].bias.grad[0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    assert prec.step(opt, clip_grad_norm=10.0) is False
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert prec.nonfinite_steps == 1


def test_skipped_steps_warn_and_count_once_the_fp16_scale_cannot_explain_them():
    model = _mlp()
    prec = Precision("fp16", "cpu", init_scale=4.0, warn_after=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    prec.backward(model(torch.randn(4, 8)).sum())  # a real scaled backward starts the scaler

    def bad_step():
        for p in model.parameters():
            p.grad = torch.full_like(p, float("inf"))
        return prec.step(opt)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert bad_step() is False and not caught
        assert bad_step() is False
        assert any("2 optimizer steps in a row" in str(w.message) for w in caught)
        assert not any("loss scale fell" in str(w.message) for w in caught)  # 4 -> 2 -> 1
        assert prec.check() == 0                      # the scale (1) is still settling: no divergence yet
        assert bad_step() is False
        assert any("loss scale fell" in str(w.message) for w in caught)  # -> 0.5 < 1
        assert bad_step() is False
    assert prec.scale == 0.25 and prec.check() == 4   # now the 4 skips count


def test_explicit_unscale_clip_step_equals_the_one_call():
    results = []
    for explicit in (False, True):
        model, (x, y) = _mlp(), _data()
        prec = Precision("fp16", "cpu", init_scale=256.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        prec.backward(nn.functional.mse_loss(model(x), y) * 1000)
        if explicit:
            prec.unscale_(opt)
            prec.unscale_(opt)                         # a second call (a retried step) does not unscale again
            norm = prec.clip_grad_norm_(opt, 1.0)
            assert norm.ndim == 0 and float(norm) > 1.0
            stepped = prec.step(opt, norm, blocking=False)
            assert isinstance(stepped, torch.Tensor) and bool(stepped)
        else:
            assert prec.step(opt, clip_grad_norm=1.0) is True
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(*results)


def test_bf16_skips_count_at_once():
    model = _mlp()
    prec = Precision("bf16", "cpu", warn_after=100)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.full_like(p, float("nan"))
        assert prec.step(opt, clip_grad_norm=10.0) is False
    assert prec.check() == 3 and prec.check() == 3    # a run still going on is read again


def test_state_dict_roundtrip():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prec = Precision("fp16", "cpu", init_scale=64.0, growth_interval=3)
    assert Precision("fp16", "cpu", init_scale=64.0).state_dict()["scaler"]["scale"] == 64.0
    prec.backward(model(torch.randn(4, 8)).sum())
    for p in model.parameters():
        p.grad = torch.full_like(p, float("inf"))
    prec.step(opt)
    state = prec.state_dict()
    assert state["precision"] == "fp16" and state["nonfinite_steps"] == 1
    fresh = Precision("fp16", "cpu")
    fresh.load_state_dict(state)
    assert fresh.scale == 32.0 and fresh.nonfinite_steps == 1
    assert fresh.scaler.get_growth_interval() == 3
    Precision("bf16", "cpu").load_state_dict(state)  # no scaler: nothing to load, no error


class _Overflow(nn.Module):
    """Outputs around 1e5: finite in fp32 and bf16, inf in fp16."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3 * 8 * 8, 4)
        nn.init.constant_(self.fc.weight, 1000.0)

    def forward(self, x):
        return self.fc(x.flatten(1))


def test_bf16_is_really_used_and_close_on_a_small_model():
    model = _Overflow()
    err = prediction_error(model, "bf16", imgsz=8)
    assert 0.0 < err < 0.01  # really computed in bf16, and close to fp32
    assert prediction_error(model, "fp16", imgsz=8) == float("inf")   # 1e5 overflows fp16


@pytest.mark.gpu
def test_fp16_grad_scaler_on_cuda():
    assert resolve_precision("auto", "cuda") == ("bf16" if torch.cuda.is_bf16_supported() else "fp16")
    model, (x, y) = _mlp(), _data()
    model, x, y = model.cuda(), x.cuda(), y.cuda()
    prec = Precision("fp16", "cuda", init_scale=2.0**10)
    assert isinstance(prec.scaler, torch.amp.GradScaler)
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    losses = []
    for _ in range(60):
        with prec.autocast():
            out = model(x)
            loss = nn.functional.mse_loss(out.float(), y)
        assert out.dtype == torch.float16
        prec.backward(loss)
        prec.step(opt, clip_grad_norm=10.0)
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0]
    with prec.autocast():
        loss = nn.functional.mse_loss(model(x).float(), y)
    prec.backward(loss)
    scale = prec.scale
    model[0].weight.grad[0, 0] = float("inf")
    assert prec.step(opt) is False and prec.scale == scale / 2


def test_bf16_on_yolov8n_is_close_to_fp32():
    import yolokit

    model = yolokit.create_model("yolov8n")
    err = prediction_error(model, "bf16", imgsz=64)
    assert 0.0 < err < 0.02  # ~2.5e-3 for a fresh model: bf16 really used, and close
