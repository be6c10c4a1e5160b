"""Activation checkpointing: same outputs, grads and BN stats; fewer saved activations."""

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import yolokit
from yolokit.accel.checkpointing import (
    checkpointed_modules,
    disable_activation_checkpointing,
    enable_activation_checkpointing,
    is_checkpointed,
)


def _block(c_in: int, c_out: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.SiLU())


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_block(3, 8), _block(8, 16), _block(16, 16), _block(16, 8), nn.Conv2d(8, 4, 1))


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x = x.clone().requires_grad_()
    out = model(x)
    (out.square().mean() + out.mean()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    grads["input"] = x.grad
    return out.detach(), grads


def _saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps for backward during one forward (activation memory proxy)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x.requires_grad_())
    return total


def test_same_outputs_grads_and_bn_stats():
    ref, ckpt = _model(), _model()
    keys = list(ckpt.state_dict())
    names = enable_activation_checkpointing(list(ckpt.named_children())[:4])
    assert names == ["0", "1", "2", "3"]
    assert list(ckpt.state_dict()) == keys  # checkpoints stay loadable
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # two steps: stats after the second depend on the first
        out_r, g_r = _step(ref, x)
        out_c, g_c = _step(ckpt, x)
        torch.testing.assert_close(out_c, out_r, rtol=0, atol=1e-6)
        for k in g_r:
            torch.testing.assert_close(g_c[k], g_r[k], rtol=0, atol=1e-6)
    for (k, a), b in zip(ref.state_dict().items(), ckpt.state_dict().values(), strict=True):
        assert torch.equal(a, b), k  # running stats updated once per forward, not twice
    assert int(ckpt[0][1].num_batches_tracked) == 2


def test_plain_checkpoint_would_double_count_bn():
    """Why the buffer restore exists: torch's recompute updates BN stats a second time."""
    model = _block(3, 4)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    checkpoint(model, x, use_reentrant=False).sum().backward()
    assert int(model[1].num_batches_tracked) == 2
    wrapped = _block(3, 4)
    enable_activation_checkpointing([wrapped])
    wrapped(x).sum().backward()
    assert int(wrapped[1].num_batches_tracked) == 1


def test_compiled_checkpointing_keeps_bn_stats_exact():
    """Under torch.compile the buffer-restoring context is not traceable; AOTAutograd writes the
    running stats once (functionalized) and the recompute replays pure ops, so stats stay exact."""
    ref, ckpt = _model(), _model()
    enable_activation_checkpointing(list(ckpt.named_children())[:4])
    compiled = torch.compile(ckpt, backend="aot_eager")
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    try:
        for _ in range(2):
            out_r, g_r = _step(ref, x)
            out_c, g_c = _step(compiled, x)
            torch.testing.assert_close(out_c, out_r, rtol=0, atol=1e-6)
            g_c = {k.removeprefix("_orig_mod."): v for k, v in g_c.items()}
            assert g_c.keys() == g_r.keys()
            for k in g_r:
                torch.testing.assert_close(g_c[k], g_r[k], rtol=0, atol=1e-6)
    finally:
        torch._dynamo.reset()
    for (k, a), b in zip(ref.state_dict().items(), ckpt.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=k)
    assert int(ckpt[0][1].num_batches_tracked) == 2 and checkpointed_modules(ckpt) == ["0", "1", "2", "3"]


def test_recompute_happens_and_saved_activations_shrink():
    model = _model()
    calls = []
    model[1][0].register_forward_hook(lambda *a: calls.append(1))
    x = torch.randn(2, 3, 32, 32)
    base = _saved_bytes(model, x)
    calls.clear()
    enable_activation_checkpointing(model[:4])
    model(x.requires_grad_()).sum().backward()
    assert len(calls) == 2  # forward + recompute in backward
    with torch.no_grad():
        model(x)
    assert len(calls) == 3  # no graph, no checkpoint, no recompute
    assert _saved_bytes(model, x) < 0.4 * base  # only block inputs are kept


def test_every_and_disable():
    model = _model()
    x = torch.randn(1, 3, 8, 8)
    expected = model(x)
    assert enable_activation_checkpointing(list(model[:4]), every=2) == ["0", "2"]
    assert checkpointed_modules(model) == ["0", "2"]
    assert enable_activation_checkpointing(list(model[:4]), every=2) == ["0", "2"]  # idempotent
    torch.testing.assert_close(model(x), expected, rtol=0, atol=1e-6)
    assert disable_activation_checkpointing([("model", model)]) == ["model.0", "model.2"]
    assert checkpointed_modules(model) == [] and "forward" not in model[0].__dict__
    with pytest.raises(ValueError):
        enable_activation_checkpointing(model, every=0)


def test_deepcopy_follows_the_copy():
    model = _model()
    enable_activation_checkpointing(model[:4])
    clone = copy.deepcopy(model)
    assert is_checkpointed(clone[0]) and clone[0].forward.module is clone[0]
    with torch.no_grad():
        clone[0][0].weight.zero_()
        clone[0][0].bias.zero_()
    x = torch.randn(1, 3, 8, 8, requires_grad=True)
    assert not torch.allclose(clone(x), model(x))  # the copy runs its own weights
    restored = pickle.loads(pickle.dumps(clone))  # e.g. a model passed to spawned processes
    assert restored[0].forward.module is restored[0] and checkpointed_modules(restored) == ["0", "1", "2", "3"]
    torch.testing.assert_close(restored(x), clone(x))


def test_keeps_a_previously_patched_forward():
    model = _block(3, 4)
    model.forward = lambda x: nn.Sequential.forward(model, x) * 2
    enable_activation_checkpointing([model])
    x = torch.randn(1, 3, 8, 8, requires_grad=True)
    ref = nn.Sequential(*model)(x) * 2
    torch.testing.assert_close(model(x), ref)
    disable_activation_checkpointing([model])
    torch.testing.assert_close(model(x), ref)


@pytest.mark.skipif(not hasattr(yolokit, "create_model"), reason="yolokit.create_model not available yet")
def test_yolov8n_same_outputs_and_grads():
    torch.manual_seed(0)
    ref = yolokit.create_model("yolov8n").train()
    ckpt = copy.deepcopy(ref)
    names = enable_activation_checkpointing(ckpt.checkpoint_units("all"))
    assert len(names) >= 4
    x = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    out_r, out_c = ref(x), ckpt(x)
    sum(o.square().mean() for o in out_r).backward()
    sum(o.square().mean() for o in out_c).backward()
    for a, b in zip(out_r, out_c, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    for (k, p), q in zip(ref.named_parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-6, msg=k)
    for (k, a), b in zip(ref.state_dict().items(), ckpt.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert _saved_bytes(ckpt, x) < _saved_bytes(ref, x)


@pytest.mark.gpu
def test_activation_memory_is_lower_on_cuda():
    def activation_peak(model: nn.Module) -> int:
        x = torch.rand(8, 3, 256, 256, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        out = model(x)
        peak = torch.cuda.max_memory_allocated() - start
        sum(o.float().mean() for o in out).backward()
        model.zero_grad(set_to_none=True)
        return peak

    model = yolokit.create_model("yolov8n").cuda().train()
    plain = activation_peak(model)
    enable_activation_checkpointing(model.checkpoint_units("all"))
    ckpt = activation_peak(model)
    assert ckpt < 0.7 * plain, (ckpt, plain)  # CPU proxy (saved tensors) gives 0.4
