"""perf: switches are set, read back, and described in one line."""

import pytest
import torch
from torch import nn

from yolokit.accel.perf import configure, describe, is_channels_last, is_compiled, prepare_model


@pytest.fixture(autouse=True)
def restore_switches():
    saved = (
        torch.backends.cudnn.benchmark,
        torch.backends.cuda.matmul.fp32_precision,
        torch.backends.cudnn.conv.fp32_precision,
    )
    yield
    torch.backends.cudnn.benchmark = saved[0]
    torch.backends.cuda.matmul.fp32_precision = saved[1]
    torch.backends.cudnn.conv.fp32_precision = saved[2]


def test_configure_sets_and_describes():
    line = configure(cudnn_benchmark=True, tf32=True)
    assert torch.backends.cudnn.benchmark is True
    assert torch.backends.cuda.matmul.fp32_precision == "tf32" == torch.backends.cudnn.conv.fp32_precision
    assert line == "cudnn.benchmark=on tf32(matmul)=on tf32(conv)=on"
    assert configure(cudnn_benchmark=False, tf32=False) == "cudnn.benchmark=off tf32(matmul)=off tf32(conv)=off"
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    assert configure() == describe() == "cudnn.benchmark=off tf32(matmul)=off tf32(conv)=off"  # None: untouched
    assert "\n" not in describe(nn.Linear(2, 2))


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
