"""The trainer's speed defaults: the fast ones on CUDA, the exact ones on the CPU."""

import os

import pytest
import torch

from yolokit.train import TrainConfig
from yolokit.train.plan import cores_per_process, speed_settings


@pytest.fixture
def sixteen_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)


def test_cuda_defaults_are_the_fast_ones(sixteen_cores):
    s = speed_settings(TrainConfig(), torch.device("cuda"))
    assert (s.deterministic, s.cudnn_benchmark, s.tf32, s.pin_memory) == (False, True, True, True)
    assert s.workers == 15                                       # every core but the training process's
    assert speed_settings(TrainConfig(), torch.device("cuda", 1), local_world=4).workers == 3   # 16 / 4 - 1


def test_cpu_defaults_keep_exact_resume(sixteen_cores):
    s = speed_settings(TrainConfig(), torch.device("cpu"))
    assert (s.deterministic, s.cudnn_benchmark, s.tf32, s.pin_memory, s.workers) == (True, False, False, False, 2)


def test_what_the_config_says_wins(sixteen_cores):
    s = speed_settings(TrainConfig(deterministic=True, workers=0, tf32=False), torch.device("cuda"))
    assert (s.deterministic, s.cudnn_benchmark, s.tf32, s.workers) == (True, False, False, 0)
    assert speed_settings(TrainConfig(deterministic=False), torch.device("cpu")).deterministic is False


def test_cores_per_process_never_drops_below_one(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert cores_per_process(1) == 2 and cores_per_process(8) == 1


def test_apply_sets_the_switches_and_keeps_both_tf32_apis_readable():
    saved = (torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.utils.deterministic.fill_uninitialized_memory)
    try:
        line = speed_settings(TrainConfig(), torch.device("cuda")).apply()
        assert line == "cudnn.benchmark=on tf32(matmul)=on tf32(conv)=on deterministic=off"
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cuda.matmul.allow_tf32
        line = speed_settings(TrainConfig(), torch.device("cpu")).apply()
        assert line == "cudnn.benchmark=off tf32(matmul)=off tf32(conv)=off deterministic=warn"
    finally:
        torch.backends.cudnn.benchmark = saved[0]
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[1:3]
        torch.use_deterministic_algorithms(saved[3], warn_only=saved[4])
        torch.backends.cudnn.deterministic, torch.utils.deterministic.fill_uninitialized_memory = saved[5:]
