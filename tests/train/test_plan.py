"""What the device decides (the fast choices on CUDA, the exact ones on the CPU), and the runtime plan."""

import os

import pytest
import torch

from yolokit.train import TrainConfig
from yolokit.train.plan import Processes, cores_per_process, device_settings


def settings_for(cfg, device, local_world=1, world=None):
    world = local_world if world is None else world
    return device_settings(cfg, Processes(device, rank=0, local_rank=0, world=world, local_world=local_world))


@pytest.fixture
def sixteen_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)


def test_cuda_defaults_are_the_fast_ones(sixteen_cores):
    s = settings_for(TrainConfig(), torch.device("cuda"))
    assert (s.deterministic, s.cudnn_benchmark, s.tf32, s.pin_memory) == (False, True, True, True)
    assert s.hsv_on_device                                       # the loader's workers only draw the HSV gains
    assert s.workers == 15                                       # every core but the training process's
    assert (s.precision, s.channels_last, s.fused_optimizer, s.sync_bn) == ("fp16", True, True, False)  # no bf16 here
    assert settings_for(TrainConfig(), torch.device("cuda", 1), local_world=4).workers == 3   # 16 / 4 - 1


def test_cpu_defaults_keep_exact_resume(sixteen_cores):
    s = settings_for(TrainConfig(), torch.device("cpu"))
    assert (s.deterministic, s.cudnn_benchmark, s.tf32, s.pin_memory, s.workers) == (True, False, False, False, 2)
    assert not s.hsv_on_device                                   # the CPU trains with HSV in the loader's workers
    assert (s.precision, s.channels_last, s.fused_optimizer, s.sync_bn) == ("fp32", True, True, False)


def test_what_the_config_says_wins(sixteen_cores):
    cfg = TrainConfig(deterministic=True, workers=0, tf32=False, hsv_on_device=False)
    s = settings_for(cfg, torch.device("cuda"))
    assert (s.deterministic, s.cudnn_benchmark, s.tf32, s.workers, s.hsv_on_device) == (True, False, False, 0, False)
    assert settings_for(TrainConfig(hsv_on_device=True), torch.device("cpu")).hsv_on_device
    assert settings_for(TrainConfig(deterministic=False), torch.device("cpu")).deterministic is False
    with pytest.warns(RuntimeWarning, match="sync_bn needs CUDA"):
        s = settings_for(TrainConfig(precision="bf16", channels_last=False, sync_bn=True), torch.device("cpu"), world=2)
    assert (s.precision, s.channels_last, s.sync_bn) == ("bf16", False, False)   # SyncBatchNorm needs CUDA


def test_sync_bn_only_where_it_can_act(sixteen_cores):
    import warnings

    cfg = TrainConfig(sync_bn=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert settings_for(TrainConfig(), torch.device("cuda"), world=8).sync_bn is False   # off unless asked
    assert settings_for(cfg, torch.device("cuda"), world=2).sync_bn is True
    with pytest.warns(RuntimeWarning, match="sync_bn needs CUDA devices"):
        assert settings_for(cfg, torch.device("cpu"), world=2).sync_bn is False
    with pytest.warns(RuntimeWarning, match="no effect in one process"):
        assert settings_for(cfg, torch.device("cuda"), world=1).sync_bn is False


def test_cores_per_process_never_drops_below_one(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert cores_per_process(1) == 2 and cores_per_process(8) == 1


def test_apply_sets_the_switches_and_keeps_both_tf32_apis_readable():
    saved = (torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.utils.deterministic.fill_uninitialized_memory)
    try:
        line = settings_for(TrainConfig(), torch.device("cuda")).apply()
        assert line == "cudnn.benchmark=on tf32(matmul)=on tf32(conv)=on deterministic=off"
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cuda.matmul.allow_tf32
        line = settings_for(TrainConfig(), torch.device("cpu")).apply()
        assert line == "cudnn.benchmark=off tf32(matmul)=off tf32(conv)=off deterministic=warn"
    finally:
        torch.backends.cudnn.benchmark = saved[0]
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[1:3]
        torch.use_deterministic_algorithms(saved[3], warn_only=saved[4])
        torch.backends.cudnn.deterministic, torch.utils.deterministic.fill_uninitialized_memory = saved[5:]


# --- the runtime plan ------------------------------------------------------------------------

def _procs(rank=0, world=1):
    from yolokit.train.plan import Processes
    return Processes(torch.device("cpu"), rank=rank, local_rank=rank, world=world, local_world=world)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("batch_per_rank", [1, 3, 8])
@pytest.mark.parametrize("size", [1, 37, 100])
@pytest.mark.parametrize("whole_steps", [False, True])
def test_the_plan_is_what_the_sampler_and_accumulator_do(world, batch_per_rank, size, whole_steps):
    from torch import nn

    from yolokit.accel.accumulation import Accumulator, accumulation_steps
    from yolokit.data.loader import ShardedBatchSampler
    from yolokit.train.plan import runtime_plan

    for rank in range(world):
        plan = runtime_plan(_procs(rank, world), batch=batch_per_rank * world, nominal_batch=64, train_size=size,
                            whole_steps=whole_steps)
        sampler = ShardedBatchSampler(size, plan.per_rank, rank=rank, world_size=world, accumulate=plan.accumulate,
                                      whole_steps=whole_steps)
        acc = Accumulator(nn.Linear(1, 1), accumulate=plan.accumulate, rank=rank, world_size=world)
        assert (plan.rank, plan.world, plan.per_rank) == (rank, world, batch_per_rank)
        assert plan.accumulate == accumulation_steps(64, plan.per_rank, world)
        assert plan.images_per_step == plan.accumulate * plan.per_rank * world
        assert plan.steps_per_epoch == sampler.steps_per_epoch
        # every rank's share of the epoch fits the plan's steps, and the Accumulator takes them all
        acc.start_epoch(len(sampler), epoch_steps=plan.steps_per_epoch)
        assert acc.steps_left == plan.steps_per_epoch >= -(-len(sampler) // plan.accumulate)


def test_the_plan_checks_its_batch_and_keeps_plain_values():
    from yolokit.train.plan import runtime_plan

    with pytest.raises(ValueError, match=r"batch 6 is the total over all processes .* \(4\); try batch 4"):
        runtime_plan(_procs(0, 4), batch=6, nominal_batch=64, train_size=10)
    plan = runtime_plan(_procs(1, 2), batch=16, nominal_batch=64, train_size=100)
    assert plan.as_dict() == {"device": "cpu", "rank": 1, "local_rank": 1, "world": 2, "local_world": 2,
                              "batch": 16, "per_rank": 8, "accumulate": 4, "images_per_step": 64,
                              "steps_per_epoch": 2}
    assert not plan.main and _procs(0, 2).main


def test_start_processes_in_one_process(clean_env):
    from yolokit.train.plan import start_processes

    procs = start_processes(TrainConfig(device="cpu"))
    assert (procs.device, procs.rank, procs.local_rank, procs.world, procs.local_world) == (
        torch.device("cpu"), 0, 0, 1, 1)
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        start_processes(TrainConfig(device="gpu"))
