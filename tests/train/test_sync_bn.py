"""``--sync-bn``: when it converts, what it says where it cannot act, and what it leaves intact."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import yolokit
from yolokit.accel.reduce import BatchNormSync
from yolokit.data import ShardedBatchSampler
from yolokit.train import TrainConfig


def test_a_converted_models_checkpoint_loads_into_a_plain_model():
    model = yolokit.create_model("yolov8n", num_classes=3).train()
    model(torch.rand(2, 3, 64, 64))                                   # running statistics away from 0 / 1
    plain_bn = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    assert sum(isinstance(m, nn.SyncBatchNorm) for m in converted.modules()) == plain_bn > 50
    state = converted.state_dict()
    fresh = yolokit.create_model("yolov8n", num_classes=3)
    fresh.load_state_dict(state)                                      # strict: the same keys and shapes
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in state.items())
    assert not any(isinstance(m, nn.SyncBatchNorm) for m in fresh.modules())


def test_batchnorm_combination_skips_syncbatchnorm_layers():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))
    assert len(BatchNormSync(model).layers) == 2
    model[3] = nn.SyncBatchNorm.convert_sync_batchnorm(model[3])
    sync = BatchNormSync(model)
    assert sync.layers == [model[1]] and len(sync.stats) == 2        # its statistics are global already


@pytest.mark.parametrize("size,world,accumulate", [(25, 2, 2), (25, 3, 1), (13, 2, 3)])
def test_whole_steps_give_every_rank_as_many_micro_batches(size, world, accumulate):
    """SyncBatchNorm runs collectives in each forward and backward: ranks must run the same count."""
    counts = [len(ShardedBatchSampler(size, 2, rank=r, world_size=world, accumulate=accumulate, whole_steps=True))
              for r in range(world)]
    uneven = [len(ShardedBatchSampler(size, 2, rank=r, world_size=world, accumulate=accumulate))
              for r in range(world)]
    group = world * accumulate
    assert len(set(counts)) == 1 and counts[0] * world == (-(-size // 2)) // group * group
    assert len(set(uneven)) > 1                                       # what it fixes


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="SyncBatchNorm over NCCL needs two GPUs")
def test_two_cuda_processes_train_with_syncbatchnorm(tmp_path):
    import _train_workers as workers

    from yolokit.accel.launcher import launch
    from yolokit.data import make_shapes

    data = str(make_shapes(tmp_path / "set", n_train=21, n_val=4, imgsz=64))
    cfg = TrainConfig(data=data, imgsz=64, batch=4, nbs=8, epochs=2, workers=0, out=str(tmp_path / "run"),
                      plots=False, mosaic_buffer=0, sync_bn=True, device="cuda")
    results = launch(workers.fit_recording, 2, cfg, timeout=600)
    digests = [r["digests"] for r in results]
    assert len(digests[0]) == 4 and digests[0] == digests[1]   # whole steps: 8 of 11 micro-batches, 2 steps an epoch
