"""Distributed helpers: no-op without a group; DDP over gloo equals one process."""

import os
import time

import _accel_workers as workers  # tests/accel is put on sys.path by conftest.py
import pytest
import torch
from torch import nn

from yolokit.accel import distributed
from yolokit.accel.launcher import LaunchError, launch


def test_helpers_without_process_group(clean_env):
    assert distributed.setup() == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert not distributed.is_initialized()
    assert "RANK" not in os.environ  # a single process leaves the environment alone
    assert (distributed.rank(), distributed.world_size(), distributed.local_rank()) == (0, 1, 0)
    assert distributed.is_main()
    x = torch.tensor([1.0, 3.0])
    assert distributed.all_reduce_mean(x) is x and distributed.all_reduce_mean(2.5) == 2.5
    assert distributed.broadcast_object({"a": 1}) == {"a": 1}
    distributed.barrier()
    model = nn.Linear(2, 2)
    assert distributed.wrap_ddp(model, sync_bn=True) is model
    assert distributed.unwrap(model) is model
    with distributed.no_sync(model, enabled=True):
        pass
    distributed.teardown()


def test_rank_helpers_read_torchrun_env(clean_env, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert (distributed.rank(), distributed.world_size(), distributed.local_rank()) == (3, 4, 1)
    assert not distributed.is_main()


def test_setup_arguments(clean_env, monkeypatch):
    calls, stores = [], []

    def rendezvous(url, rank, world_size, timeout):
        stores.append(distributed.dist.HashStore())
        calls.append(("rendezvous", url, rank, world_size, timeout))
        yield stores[-1], rank, world_size

    monkeypatch.setattr(distributed.dist, "rendezvous", rendezvous)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda *a, **k: calls.append((a, k)))
    distributed.setup("gloo", rank=1, world_size=2, master_addr="10.0.0.7", master_port=1234, timeout=5)
    assert calls[0][:4] == ("rendezvous", "tcp://10.0.0.7:1234", 1, 2) and calls[0][4].total_seconds() == 5
    (backend,), kwargs = calls[1]
    assert backend == "gloo" and (kwargs["rank"], kwargs["world_size"]) == (1, 2)
    assert kwargs["timeout"].total_seconds() == 5
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("1", "2", "1")
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "node0"), ("MASTER_PORT", "29400"),
                 ("TORCHELASTIC_RESTART_COUNT", "2")):
        monkeypatch.setenv(k, v)
    distributed.setup()
    assert calls[2][:4] == ("rendezvous", "env://", 0, 4)
    _, kwargs = calls[3]
    assert (kwargs["rank"], kwargs["world_size"]) == (0, 4) and kwargs["timeout"].total_seconds() == 1800
    # a restarted group's keys live under their own prefix, apart from the dead group's
    kwargs["store"].set("rank_0", "addr")
    assert stores[-1].get("yolokit/attempt2/rank_0") == b"addr"


def test_unwrap_compiled_module():
    model = nn.Linear(2, 2)

    class Compiled(nn.Module):  # stands in for torch.compile's wrapper, which holds _orig_mod
        def __init__(self, m):
            super().__init__()
            self._orig_mod = m

    assert distributed.unwrap(Compiled(model)) is model


def test_ddp_gloo_two_processes_matches_one_process(gloo_suite):
    assert [res["ddp"]["rank"] for res in gloo_suite] == [0, 1]
    for r in (res["ddp"] for res in gloo_suite):
        assert r["world"] == 2 and r["local_rank"] == r["rank"] and r["is_main"] == (r["rank"] == 0)
        assert r["wrapped"] == "DistributedDataParallel" and r["unwrapped"] == "Sequential"
        assert r["grad_diff"] < 1e-6, r  # DDP-averaged grads == grads of the concatenated batch
        assert r["weight_diff"] < 1e-6, r


def test_ddp_with_no_sync_takes_the_accumulators_step(gloo_suite):
    """wrap_ddp + no_sync, the alternative to the Accumulator, accumulates to the same step on 2 ranks."""
    for res in gloo_suite:
        assert res["ddp_no_sync"]["relative_diff"] < 1e-6, res["ddp_no_sync"]


def test_reductions_broadcast_and_sync_bn(gloo_suite):
    for r in (res["ddp"] for res in gloo_suite):
        assert r["mean_tensor"] == [0.5, 1.0]
        assert r["mean_int"] == 0.5 and r["mean_float"] == 0.5
        assert r["broadcast"] == {"from": 0, "dir": "runs/exp0"}
        layer, messages = r["sync_bn"]  # SyncBatchNorm is CUDA-only: on CPU it warns and keeps BN
        assert layer == "BatchNorm2d" and any("SyncBatchNorm needs CUDA" in m for m in messages)


def test_accumulation_over_uneven_shards_equals_one_process(gloo_suite):
    rank0, rank1 = (res["uneven"] for res in gloo_suite)
    assert rank0["steps"] == rank1["steps"] == 2 and rank0["epoch_steps"] == rank1["epoch_steps"] == 2
    assert rank0["stepped_after"] == [1, 2]          # rank 0 ran 3 batches: 2, then 1
    assert rank1["stepped_after"] == [1, "empty"]    # rank 1 ran 2, then joined the last step with nothing
    assert rank0["local_grad"] != rank1["local_grad"]  # backward really ran locally, without an all-reduce
    for r in (rank0, rank1):
        assert len(r["grad_diff"]) == 2 and max(r["grad_diff"]) < 1e-5, r   # summed over ranks, every step
        assert r["weight_diff"] < 1e-6, r
        assert r["bn_diff"] < 1e-6, r    # running statistics as one process updating 5 times in order
        assert r["bn_tracked"] == 5


def test_oom_on_one_rank_replays_its_step(gloo_suite):
    rank0, rank1 = (res["oom_replay"] for res in gloo_suite)
    assert rank0["splits"] == 2 and rank0["seen"] == [2, 2, 1, 1, 1, 1]  # failed, then both batches as 1 + 1
    assert rank1["splits"] == 1 and rank1["seen"] == [2, 2]
    for r in (rank0, rank1):
        assert r["stepped"] and r["grad_diff"] < 1e-5, r
        assert r["weight_diff"] < 1e-6, r


def test_all_gather_and_broadcast_module(gloo_suite):
    for res in gloo_suite:
        assert res["gather"]["gathered"] == [{"rank": 0}, {"rank": 1}]
        assert res["gather"]["diff"] == 0.0   # every rank now holds rank 0's weights


def test_ranks_decide_together_what_one_rank_ran_into(gloo_suite):
    rank0, rank1 = (res["agree"] for res in gloo_suite)
    # the exchange: max over ranks of what each proposed, decided one boundary later, the same on both
    expected = [(0, 0), (1, 0), (7, 0), (1, 0)]
    assert rank0["votes"] == rank1["votes"] == expected
    # rank 1 could not allocate its flat bucket: both summed in place, and the sums are right
    assert rank0["sums"] == rank1["sums"] == [3.0 * (i + 1) for i in range(len(rank0["sums"]))]
    # after a step some rank retried: rank 0's parameters and momentum everywhere, multi-tensor kernels off
    assert rank0["resynced"] == rank1["resynced"] and rank0["resynced"][0] == rank1["resynced"][1]
    assert rank0["foreach"] is False and rank1["foreach"] is False


def test_a_rank_that_raises_does_not_hang_the_others(clean_env, forked_ranks):
    start = time.monotonic()
    with pytest.raises(LaunchError) as err:
        launch(workers.rank_one_raises, 2, timeout=90)
    assert 1 in err.value.ranks and err.value.rank in (0, 1)
    assert "ValueError: boom on rank 1" in str(err.value)  # the cause travels to the parent
    assert time.monotonic() - start < 60  # rank 0 was stopped, not left waiting in barrier
