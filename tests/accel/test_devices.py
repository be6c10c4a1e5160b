"""One device resolver: names, validation, consecutive devices per local rank, set_device in every process."""

import pytest
import torch

from yolokit.accel import distributed
from yolokit.accel.amp import Precision
from yolokit.accel.devices import resolve_device, use_device


@pytest.fixture
def four_gpus(monkeypatch):
    """A machine with 4 CUDA devices, as far as the resolver asks; records set_device calls."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(torch.device(d)))
    return calls


def test_names_on_a_cpu_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == resolve_device(None) == resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu"), local_rank=1, local_world=2) == torch.device("cpu")
    for bad, says in (("gpu", "unknown device 'gpu'"), ("mps", "unknown device 'mps'"),
                      ("cuda", "'cuda' asked for, but CUDA is not available"),
                      ("cuda:1", "'cuda:1' asked for, but CUDA is not available")):
        with pytest.raises(ValueError, match=says):
            resolve_device(bad)
    with pytest.raises(ValueError, match="local_rank 2 is not in"):
        resolve_device("cpu", local_rank=2, local_world=2)


def test_cuda_indices_one_and_several_processes(four_gpus):
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:3") == torch.device("cuda", 3)
    # several processes take consecutive devices from the one named: the index is kept
    assert [resolve_device("cuda", local_rank=r, local_world=4).index for r in range(4)] == [0, 1, 2, 3]
    assert [resolve_device("cuda:1", local_rank=r, local_world=2).index for r in range(2)] == [1, 2]
    assert [resolve_device("auto", local_rank=r, local_world=2).index for r in range(2)] == [0, 1]
    with pytest.raises(ValueError, match=r"'cuda:4' with 1 process\(es\) on this machine needs cuda:4, but there "
                                         r"are 4 CUDA devices"):
        resolve_device("cuda:4")
    with pytest.raises(ValueError, match=r"'cuda:2' with 3 process\(es\).*needs cuda:2..cuda:4, but there are 4"):
        resolve_device("cuda:2", local_rank=0, local_world=3)


def test_setup_makes_the_device_current_in_one_process_too(four_gpus, clean_env):
    assert distributed.setup(device="cuda:2") == torch.device("cuda", 2)
    assert four_gpus == [torch.device("cuda", 2)]        # one process on cuda:N calls set_device
    assert not distributed.is_initialized()
    assert use_device(torch.device("cpu")) == torch.device("cpu") and len(four_gpus) == 1


def test_setup_keeps_the_index_with_several_processes(four_gpus, clean_env, monkeypatch):
    joined = []
    monkeypatch.setattr(distributed.dist, "rendezvous", lambda *a, **k: iter([(distributed.dist.HashStore(), 1, 2)]))
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda *a, **k: joined.append((a, k)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    device = distributed.setup(rank=1, world_size=2, local_rank=1, master_port=1, device="cuda:1")
    assert device == torch.device("cuda", 2) and four_gpus == [device]
    (backend,), kwargs = joined[0]
    assert backend == "nccl" and kwargs["device_id"] == device


def test_precision_resolves_its_device_the_same_way(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert Precision("auto", None).device == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        Precision("fp32", "tpu")
