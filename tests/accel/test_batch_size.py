"""find_batch_size, the memory model, split_batch and OOMGuard, with injected OOMs."""

import copy

import pytest
import torch
from torch import nn

from yolokit.accel import batch_size as bs
from yolokit.accel.batch_size import (
    MemoryModel,
    OOMGuard,
    find_batch_size,
    fit_memory_model,
    free_memory,
    predict_batch_size,
    split_batch,
)


@pytest.fixture(autouse=True)
def no_gc(monkeypatch):
    """free_memory() runs gc.collect(), which takes ~0.1 s per trial in a test process."""
    calls = []
    monkeypatch.setattr(bs, "free_memory", lambda: calls.append(1))
    return calls


def oom_above(limit: int, tried: list[int]):
    def step(size: int) -> None:
        tried.append(size)
        if size > limit:
            raise torch.OutOfMemoryError(f"injected at {size}")

    return step


def test_binsearch_finds_the_exact_limit():
    tried = []
    assert find_batch_size(oom_above(20, tried), mode="binsearch", margin=0.0) == 20
    assert tried == [1, 2, 4, 8, 16, 32, 24, 20, 22, 21]


def test_power_mode_and_margin():
    assert find_batch_size(oom_above(20, []), mode="power", margin=0.0) == 16
    assert find_batch_size(oom_above(20, []), mode="binsearch", margin=0.1) == 18
    assert find_batch_size(oom_above(1000, []), start=3, max_size=100, margin=0.0) == 100
    tried = []
    assert find_batch_size(oom_above(10**6, tried), max_size=40, margin=0.0) == 40
    assert tried == [1, 2, 4, 8, 16, 32, 40]


def test_memory_is_freed_between_trials(no_gc):
    tried = []
    find_batch_size(oom_above(5, tried), mode="binsearch")
    assert tried == [1, 2, 4, 8, 6, 5] and len(no_gc) == len(tried)
    free_memory()  # the real one (imported before the patch) runs without CUDA too


def test_start_must_fit_and_other_errors_propagate():
    with pytest.raises(RuntimeError, match="batch size 8 does not fit"):
        find_batch_size(oom_above(4, []), start=8)

    def broken(size):
        raise ValueError("not an OOM")

    with pytest.raises(ValueError, match="not an OOM"):
        find_batch_size(broken)
    with pytest.raises(ValueError):
        find_batch_size(oom_above(4, []), mode="linear")


def test_memory_model_fit_and_prediction():
    model = fit_memory_model([1, 2, 4, 8], [100 + 10 * b for b in (1, 2, 4, 8)])
    assert model.fixed_bytes == pytest.approx(100.0) and model.per_sample_bytes == pytest.approx(10.0)
    assert model.predict(30) == pytest.approx(400.0)
    assert model.batch_size_for(805.0) == 70 and model.batch_size_for(50.0) == 0
    with pytest.raises(ValueError):
        fit_memory_model([4, 4], [1.0, 2.0])
    with pytest.raises(ValueError):
        MemoryModel(100.0, 0.0).batch_size_for(1000.0)


def test_predict_batch_size_cross_checks_with_a_search():
    measure = lambda b: 100 + 10 * b  # noqa: E731
    kwargs = dict(fraction=0.8, total_bytes=1000.0, measure=measure)
    assert predict_batch_size(oom_above(1000, []), **kwargs) == 70  # (800 - 100) / 10, and it fits
    assert predict_batch_size(oom_above(60, []), verify=False, **kwargs) == 70
    tried = []
    assert predict_batch_size(oom_above(60, tried), **kwargs) == 60  # prediction OOMs: search below it
    assert tried[0] == 70 and max(tried) <= 70
    assert predict_batch_size(oom_above(1000, []), max_size=32, **kwargs) == 32


def test_split_batch_follows_the_batch_contract():
    images = torch.arange(5.0).view(5, 1, 1, 1).expand(5, 3, 2, 2)
    targets = torch.tensor(
        [[0, 1, 0, 0, 1, 1], [2, 0, 0, 0, 2, 2], [3, 1, 1, 1, 2, 2], [4, 2, 0, 0, 1, 1], [4, 0, 1, 1, 3, 3]]
    )
    batch = {"images": images, "targets": targets.float(), "paths": list("abcde"), "epoch": 3}
    (first, w1), (second, w2) = split_batch(batch, 2)
    assert (w1, w2) == (0.6, 0.4)
    assert first["images"][:, 0, 0, 0].tolist() == [0, 1, 2] and second["images"][:, 0, 0, 0].tolist() == [3, 4]
    assert first["targets"][:, 0].tolist() == [0, 2] and second["targets"][:, 0].tolist() == [0, 1, 1]
    torch.testing.assert_close(second["targets"][:, 1:], targets[2:, 1:].float())
    assert first["paths"] == ["a", "b", "c"] and second["paths"] == ["d", "e"] and second["epoch"] == 3
    assert targets[0, 0] == 0 and batch["targets"][2, 0] == 3  # input untouched
    x, y = torch.randn(4, 2), torch.randn(4)
    parts = split_batch((x, y), 8)  # capped at one image per part
    assert len(parts) == 4 and all(w == 0.25 for _, w in parts)
    assert torch.equal(torch.cat([p[0] for p, _ in parts]), x) and isinstance(parts[0][0], tuple)


def _train(guard: OOMGuard | None, limit_from_step: int | None, steps: int = 3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 2))
    if guard is not None:
        guard.model = model
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    seen = []
    for step in range(steps):
        batch = {"images": torch.randn(8, 3, 6, 6, generator=gen), "labels": torch.randn(8, 2, generator=gen)}

        def micro_step(micro, weight, step=step):
            loss = nn.functional.mse_loss(model(micro["images"]), micro["labels"]) * weight
            loss.backward()  # gradients are partly accumulated when the "OOM" hits
            seen.append((step, len(micro["images"])))
            if limit_from_step is not None and step >= limit_from_step and len(micro["images"]) > 4:
                raise torch.OutOfMemoryError("injected")
            return loss.detach()

        if guard is None:
            micro_step(batch, 1.0)
        else:
            guard.run(micro_step, batch)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, seen


def test_oom_guard_keeps_the_effective_batch_and_the_weights():
    ref, _ = _train(None, None)
    guard = OOMGuard(nn.Identity())
    with pytest.warns(RuntimeWarning, match="retrying with 2 micro-batches of <= 4"):
        model, seen = _train(guard, limit_from_step=1)
    assert guard.splits == 2 and guard.recoveries == 1 and guard.micro_batch(8) == 4
    assert seen == [(0, 8), (1, 8), (1, 4), (1, 4), (2, 4), (2, 4)]  # 8 images per step throughout
    for (k, a), b in zip(ref.state_dict().items(), model.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=k)


def test_oom_guard_gives_up_below_the_minimum():
    model = nn.Linear(2, 1)
    guard = OOMGuard(model, min_micro_batch=2)

    def always_oom(micro, weight):
        raise torch.OutOfMemoryError("injected")

    with pytest.warns(RuntimeWarning), pytest.raises(torch.OutOfMemoryError):
        guard.run(always_oom, torch.randn(8, 2))
    assert guard.splits == 4  # 8 -> 4 -> 2 images, then it stops
    model_copy = copy.deepcopy(model)
    assert OOMGuard(model_copy).run(lambda m, w: (len(m), w), torch.randn(3, 2)) == [(3, 1.0)]


@pytest.mark.gpu
def test_real_cuda_oom_is_found_and_predicted(monkeypatch):
    monkeypatch.setattr(bs, "free_memory", lambda: torch.cuda.empty_cache())
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    base = torch.cuda.memory_allocated()
    budget = base + 2**30  # cap this process at ~1 GiB above what it holds now
    torch.cuda.set_per_process_memory_fraction(budget / total)
    per_sample = 32 * 2**20  # each image: a 32 MiB activation and its 32 MiB square

    def step(b: int) -> None:
        a = torch.ones(b, per_sample // 4, device="cuda")
        (a * a).sum().item()

    try:
        found = find_batch_size(step, mode="binsearch", margin=0.0, max_size=64)
        assert 8 <= found < 16  # 1 GiB / 64 MiB = 16, less allocator overhead
        step(found)
        with pytest.raises(torch.OutOfMemoryError):
            step(found + 1)
        torch.cuda.empty_cache()
        predicted = predict_batch_size(step, fraction=1.0, total_bytes=budget, probe_sizes=(1, 2, 4), verify=True)
        assert abs(predicted - found) <= 1
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def test_oom_guard_keeps_gradients_accumulated_before_the_batch():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    nn.functional.mse_loss(model(x[:4]), y[:4]).backward()  # an earlier micro-step of the accumulation
    nn.functional.mse_loss(model(x[4:]), y[4:]).backward()
    expected = model.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x[:4]), y[:4]).backward()
    calls = []

    def micro_step(micro, weight):
        xb, yb = micro
        (nn.functional.mse_loss(model(xb), yb) * weight).backward()
        calls.append(len(xb))
        if len(xb) > 2:
            raise torch.OutOfMemoryError("injected")

    with pytest.warns(RuntimeWarning):
        OOMGuard(model).run(micro_step, (x[4:], y[4:]))
    assert calls == [4, 2, 2]
    torch.testing.assert_close(model.weight.grad, expected, rtol=0, atol=1e-6)
