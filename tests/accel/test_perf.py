"""perf: switches are set, read back, and described in one line."""

import os

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter
from torch.profiler import ProfilerActivity, profile

from yolokit.accel.perf import configure, describe, is_channels_last, is_compiled, prepare_model


@pytest.fixture(autouse=True)
def restore_switches():
    saved = (
        torch.backends.cudnn.benchmark,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.deterministic,
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    yield
    torch.backends.cudnn.benchmark = saved[0]
    torch.backends.cuda.matmul.allow_tf32 = saved[1]
    torch.backends.cudnn.allow_tf32 = saved[2]
    torch.backends.cudnn.deterministic = saved[3]
    torch.use_deterministic_algorithms(saved[4], warn_only=saved[5])
    torch.utils.deterministic.fill_uninitialized_memory = saved[6]
    if saved[7] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = saved[7]


def test_configure_sets_and_describes():
    line = configure(cudnn_benchmark=True, tf32=True, deterministic=False)
    assert torch.backends.cudnn.benchmark is True
    assert torch.backends.cuda.matmul.fp32_precision == "tf32" == torch.backends.cudnn.conv.fp32_precision
    assert line == "cudnn.benchmark=on tf32(matmul)=on tf32(conv)=on deterministic=off"
    assert configure(cudnn_benchmark=False, tf32=False) == (
        "cudnn.benchmark=off tf32(matmul)=off tf32(conv)=off deterministic=off")
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    for tf32 in (True, False):   # both of PyTorch's TF32 APIs stay readable (inductor's autotune reads both)
        configure(tf32=tf32)
        assert torch.backends.cuda.matmul.allow_tf32 is tf32 and torch.backends.cudnn.allow_tf32 is tf32
        assert torch.get_float32_matmul_precision() == ("high" if tf32 else "highest")
        assert torch.backends.cuda.matmul.fp32_precision == ("tf32" if tf32 else "ieee")
    assert configure() == describe() == (  # None: untouched
        "cudnn.benchmark=off tf32(matmul)=off tf32(conv)=off deterministic=off")
    assert "\n" not in describe(nn.Linear(2, 2))


def _fills_in_empty() -> int:
    """How many fill_ calls torch.empty makes (the profiler sees the ones inside the op)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.empty(1000)
        torch.empty_like(torch.empty(0)).resize_(10)
    return sum(e.name == "aten::fill_" for e in prof.events())


def test_deterministic_without_filling_uninitialized_memory(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    configure(cudnn_benchmark=True, deterministic=False)
    assert _fills_in_empty() == 0
    torch.use_deterministic_algorithms(True)
    assert _fills_in_empty() >= 2  # PyTorch's default in deterministic mode: NaN-fill every empty
    line = configure(deterministic=True)
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert _fills_in_empty() == 0  # deterministic kernels, no fills
    assert line.startswith("cudnn.benchmark=off") and line.endswith("deterministic=warn")  # warn-only mode
    assert configure(deterministic=True, cudnn_benchmark=True).startswith("cudnn.benchmark=on")  # explicit wins
    configure(deterministic=False)
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
    assert torch.utils.deterministic.fill_uninitialized_memory  # PyTorch's default back


def test_channels_last_and_compile_switches():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Conv2d(8, 4, 3))
    assert is_channels_last(model) is False
    same = prepare_model(model, channels_last=True)
    assert same is model and is_channels_last(model) is True
    assert model[0].weight.stride() == (27, 1, 9, 3)  # NHWC strides of a [8, 3, 3, 3] weight
    assert describe(model).endswith("channels_last=on compile=off")
    x = torch.randn(1, 3, 8, 8).to(memory_format=torch.channels_last)
    assert model(x).shape == (1, 4, 4, 4)
    prepare_model(model, channels_last=False)
    assert is_channels_last(model) is False and model[0].weight.is_contiguous()
    assert is_channels_last(nn.Linear(2, 2)) is None and "channels_last=n/a" in describe(nn.Linear(2, 2))
    compiled = prepare_model(model, compile=True)  # lazy: nothing compiles until it is called
    assert compiled is not model and is_compiled(compiled) and not is_compiled(model)
    assert describe(compiled).endswith("channels_last=off compile=on")
    counter = CompileCounter()  # the backend is passed through; tests/accel/test_compile.py trains compiled
    traced = prepare_model(model, compile=True, compile_backend=counter)
    torch.testing.assert_close(traced(x), model(x))
    assert counter.frame_count == 1
    torch._dynamo.reset()
