"""Functions run in processes started by ``launch`` (spawned children import this module).

Kept out of the test files so children import a plain module by name, whatever pytest's
import mode. Each worker returns plain numbers for the parent to assert on.
"""

import os
import time
import warnings

import torch
from torch import nn

from yolokit.accel import distributed
from yolokit.accel.accumulation import Accumulator
from yolokit.accel.batch_size import OOMGuard

TIMEOUT_S = 30.0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.SiLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 3))


def _batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    return torch.randn(n, 3, 6, 6, generator=g), torch.randn(n, 3, generator=g)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((u - v).abs().max()) for u, v in zip(a, b, strict=True))


def ddp_suite() -> dict:
    """Everything checked over one 2-process gloo group (starting processes is the slow part)."""
    out = {"env": report_env("suite")}
    distributed.setup(timeout=TIMEOUT_S)
    out["ddp"] = ddp_matches_single_process()
    out["accumulation"] = accumulation_matches_big_batch()
    out["oom_guard"] = oom_guard_recovers_on_one_rank()
    distributed.teardown()
    out["torch_threads"] = torch.get_num_threads()
    return out


def ddp_matches_single_process() -> dict:
    """One DDP step on 2 x 4 images vs one local step on the concatenated 8 images."""
    r, w = distributed.rank(), distributed.world_size()
    out = {"rank": r, "world": w, "is_main": distributed.is_main(), "local_rank": distributed.local_rank()}

    x, y = _batch(4 * w)
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    _loss(ref, x, y).backward()
    ref_grads = [p.grad.clone() for p in ref.parameters()]
    ref_opt.step()

    model = distributed.wrap_ddp(_model())
    out["wrapped"] = type(model).__name__
    out["unwrapped"] = type(distributed.unwrap(model)).__name__
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    shard = slice(4 * r, 4 * r + 4)
    _loss(model, x[shard], y[shard]).backward()
    out["grad_diff"] = _max_diff([p.grad for p in model.parameters()], ref_grads)
    opt.step()
    out["weight_diff"] = _max_diff(list(model.parameters()), list(ref.parameters()))

    out["mean_tensor"] = distributed.all_reduce_mean(torch.tensor([float(r), 2.0 * r])).tolist()
    out["mean_int"] = distributed.all_reduce_mean(torch.tensor(r)).item()
    out["mean_float"] = distributed.all_reduce_mean(float(r))
    out["broadcast"] = distributed.broadcast_object({"from": r, "dir": f"runs/exp{r}"})
    distributed.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bn = distributed.wrap_ddp(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)), sync_bn=True).module[1]
    out["sync_bn"] = (type(bn).__name__, [str(w.message) for w in caught])
    return out


def accumulation_matches_big_batch() -> dict:
    """4 accumulated micro-batches of 2 per rank (no_sync on the first 3) vs one batch of 16."""
    r, w = distributed.rank(), distributed.world_size()
    acc = Accumulator(nominal_batch=16, batch_size=2, world_size=w)
    out = {"steps": acc.steps}

    x, y = _batch(16)
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    _loss(ref, x, y).backward()
    ref_grads = [p.grad.clone() for p in ref.parameters()]
    ref_opt.step()

    model = distributed.wrap_ddp(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    mine_x, mine_y = x[8 * r : 8 * r + 8], y[8 * r : 8 * r + 8]
    stepped_at = []
    for i in range(4):
        with acc.micro_step(model):
            (_loss(model, mine_x[2 * i : 2 * i + 2], mine_y[2 * i : 2 * i + 2]) * acc.loss_weight).backward()
        if i == 0:  # after a no_sync micro-step each rank holds only its own gradient
            g = model.module[0].weight.grad.clone()
            out["first_grad_rank_spread"] = float((distributed.all_reduce_mean(g) - g).abs().max())
        if acc.should_step():
            stepped_at.append(i)
            out["grad_diff"] = _max_diff([p.grad for p in model.parameters()], ref_grads)
            opt.step()
            opt.zero_grad(set_to_none=True)
    out["stepped_at"] = stepped_at
    out["weight_diff"] = _max_diff(list(model.parameters()), list(ref.parameters()))
    return out


def oom_guard_recovers_on_one_rank() -> dict:
    """Rank 0 runs out of memory at 4 images and splits; rank 1 does not; grads still match."""
    r = distributed.rank()
    x, y = _batch(8)
    ref = _model()
    _loss(ref, x, y).backward()

    model = distributed.wrap_ddp(_model())
    guard = OOMGuard(model)
    seen = []

    def micro_step(micro, weight):
        mx, my = micro
        seen.append(len(mx))
        if r == 0 and len(mx) > 2:
            raise torch.OutOfMemoryError("injected")  # before the forward: DDP state untouched
        (_loss(model, mx, my) * weight).backward()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        guard.run(micro_step, (x[4 * r : 4 * r + 4], y[4 * r : 4 * r + 4]))
    grads = [p.grad for p in model.parameters()]
    return {"splits": guard.splits, "seen": seen, "grad_diff": _max_diff(grads, [p.grad for p in ref.parameters()])}


def rank_one_raises() -> None:
    """Rank 1 fails mid-run while rank 0 waits in collectives that would never complete."""
    distributed.setup(timeout=TIMEOUT_S)
    if distributed.rank() == 1:
        raise ValueError("boom on rank 1")
    distributed.barrier()
    distributed.all_reduce_mean(torch.ones(3))


def sleep_forever() -> None:
    while True:
        time.sleep(0.5)


def report_env(tag: str) -> dict:
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {"tag": tag, "pid": os.getpid(), **{k: os.environ.get(k) for k in keys}}
