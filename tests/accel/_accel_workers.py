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
from yolokit.accel.oom import resync, run_batch

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
    out["ddp_no_sync"] = ddp_accumulation_matches_the_accumulator()
    out["uneven"] = accumulation_over_uneven_shards()
    out["oom_replay"] = oom_replay_on_one_rank()
    out["gather"] = gather_and_broadcast()
    out["agree"] = ranks_agree_on_stops_and_ooms()
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


def ddp_accumulation_matches_the_accumulator() -> dict:
    """The two ways of training on several processes take the same steps: PyTorch's DDP (``wrap_ddp``,
    ``no_sync`` on every backward but a step's last; it averages over ranks) and the Accumulator (it sums)."""
    r, w = distributed.rank(), distributed.world_size()
    x, y = _batch(8 * w)
    shards = [(x[8 * r + 4 * k:8 * r + 4 * k + 4], y[8 * r + 4 * k:8 * r + 4 * k + 4]) for k in range(2)]
    ddp = distributed.wrap_ddp(_model())
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for k, (xb, yb) in enumerate(shards):
        with distributed.no_sync(ddp, enabled=k == 0):            # the step's last backward syncs
            (_loss(ddp, xb, yb) * len(xb) * w).backward()         # * w: DDP averages, the Accumulator sums
    ddp_opt.step()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accumulator(model, accumulate=2)
    acc.start_epoch(2)
    for xb, yb in shards:
        (_loss(model, xb, yb) * len(xb)).backward()
        acc.ran((xb, yb))
    assert acc.step_due()
    acc.sync()
    opt.step()
    scale = max(float(p.abs().max()) for p in model.parameters())
    return {"relative_diff": _max_diff(list(distributed.unwrap(ddp).parameters()), list(model.parameters())) / scale}


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=0.1), nn.SiLU(),
                         nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def _sequential_reference(micro_batches: list, steps: list[list[int]], make=_bn_model) -> tuple[list, list, dict]:
    """One process running every micro-batch in order, summing gradients ("sum" reduction),
    one SGD step per entry of ``steps`` (indices of its micro-batches)."""
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in steps:
        for i in step:
            x, y = micro_batches[i]
            (_loss(model, x, y) * len(x)).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads, list(model.parameters()), {k: v.clone() for k, v in model.state_dict().items()}


def accumulation_over_uneven_shards() -> dict:
    """World 2, 2 batches per rank per step; rank 0 has 3 batches, rank 1 has 2 (an empty last step).

    Equals one process that runs rank 0's, then rank 1's batches of each step in turn: the
    gradients at every step, the weights, and BatchNorm's running statistics.
    """
    r = distributed.rank()
    x, y = _batch(10)
    micro = [(x[2 * i:2 * i + 2], y[2 * i:2 * i + 2]) for i in range(5)]
    shards = {0: [0, 1, 4], 1: [2, 3]}   # step 0: rank 0 -> 0, 1; rank 1 -> 2, 3. step 1: rank 0 -> 4
    ref_grads, ref_params, ref_state = _sequential_reference(micro, [[0, 1, 2, 3], [4]])

    model = _bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accumulator(model, accumulate=2)
    out = {"steps": acc.accumulate, "stepped_after": [], "grad_diff": []}
    acc.start_epoch(len(shards[r]))
    out["epoch_steps"] = acc.steps_left

    def step():
        acc.sync()
        out["grad_diff"].append(_max_diff([p.grad for p in model.parameters()], ref_grads[len(out["grad_diff"])]))
        opt.step()
        opt.zero_grad(set_to_none=True)

    for k, i in enumerate(shards[r]):
        for x, y in acc.micro_batches(micro[i]):
            (_loss(model, x, y) * len(x)).backward()
        acc.ran(micro[i])
        if k == 0:
            out["local_grad"] = float(model[0].weight.grad.abs().sum())  # before any all-reduce
        if acc.step_due():
            out["stepped_after"].append(k)
            step()
    while acc.step_due():
        out["stepped_after"].append("empty")
        step()
    out["weight_diff"] = _max_diff(list(model.parameters()), ref_params)
    state = model.state_dict()
    out["bn_diff"] = max(float((state[k].float() - ref_state[k].float()).abs().max()) for k in ref_state)
    out["bn_tracked"] = int(state["1.num_batches_tracked"])
    return out


def oom_replay_on_one_rank() -> dict:
    """Rank 0 runs out of memory in its second batch of a step (after a partial backward).

    No BatchNorm here: split micro-batches would change its batch statistics."""
    r = distributed.rank()
    x, y = _batch(8)
    micro = [(x[2 * i:2 * i + 2], y[2 * i:2 * i + 2]) for i in range(4)]
    ref_grads, ref_params, _ = _sequential_reference(micro, [[0, 1, 2, 3]], make=_model)

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accumulator(model, accumulate=2)
    acc.start_epoch(2)
    seen, failed = [], []

    def forward_backward(mb):
        (_loss(model, *mb) * len(mb[0])).backward()
        seen.append(len(mb[0]))
        if r == 0 and len(mb[0]) > 1 and mb[0] is micro[1][0] and not failed:
            failed.append(1)
            raise torch.OutOfMemoryError("injected after a backward")   # gradients half accumulated

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in (2 * r, 2 * r + 1):
            run_batch(acc, micro[i], forward_backward)
    stepped = acc.step_due()
    acc.sync()
    grads = [p.grad for p in model.parameters()]
    out = {"splits": acc.splits, "seen": seen, "stepped": stepped, "grad_diff": _max_diff(grads, ref_grads[0])}
    opt.step()
    out["weight_diff"] = _max_diff(list(model.parameters()), ref_params)
    return out


def ranks_agree_on_stops_and_ooms() -> dict:
    """Decisions one rank's trouble forces on all: the per-step exchange, the bucket all-reduce
    after one rank could not allocate its buffers, and the resync after a retried step."""
    from dataclasses import dataclass

    from yolokit.accel import reduce
    from yolokit.accel.agreement import RankExchange

    @dataclass(frozen=True)
    class Votes:
        signal: int = 0
        retries: int = 0

    r, out = distributed.rank(), {}
    with RankExchange(Votes, world_size=2) as exchange:   # rank 1 proposes 7 at boundary 1; all decide it at 2
        out["votes"] = [(lambda v: (v.signal, v.retries))(exchange(Votes(signal=7 if r == 1 and k == 1 else r)))
                        for k in range(4)]

    model = _model()
    for i, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, float(r + 1) * (i + 1))
    real_cat = torch.cat

    def cat_out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("injected: no room for the flat bucket")

    torch.cat = cat_out_of_memory if r == 1 else real_cat
    try:
        reduce.all_reduce_gradients(list(model.parameters()))
    finally:
        torch.cat = real_cat
    out["sums"] = [float(p.grad.flatten()[0]) for p in model.parameters()]   # (1 + 2) * (i + 1) on both

    torch.manual_seed(r)                      # different weights and momentum on each rank
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    acc = Accumulator(model, accumulate=1, world_size=2)
    resync(acc, opt)
    flat = torch.cat([t.flatten() for t in [*model.parameters(), *(opt.state[p]["momentum_buffer"]
                                                                  for p in model.parameters())]])
    out["resynced"] = distributed.all_gather_object(flat.tolist())
    out["foreach"] = opt.param_groups[0]["foreach"]
    return out


def gather_and_broadcast() -> dict:
    r = distributed.rank()
    torch.manual_seed(r)  # different weights on each rank
    model = _bn_model() if r == 0 else nn.Sequential(*[m for m in _bn_model()])
    if r == 1:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    distributed.broadcast_module(model)
    reference = _bn_model()
    return {"gathered": distributed.all_gather_object({"rank": r}),
            "diff": _max_diff(list(model.parameters()), list(reference.parameters()))}


def rank_one_raises() -> None:
    """Rank 1 fails mid-run while rank 0 waits in collectives that would never complete."""
    distributed.setup(timeout=TIMEOUT_S)
    if distributed.rank() == 1:
        raise ValueError("boom on rank 1")
    distributed.barrier()
    distributed.all_reduce_mean(torch.ones(3))


def rank_one_fails_while_a_stop_comes(ready: str) -> None:
    """Rank 1 fails and, while it handles the failure, the launcher's SIGINT arrives; rank 0 just waits."""
    if int(os.environ["RANK"]) == 1:
        try:
            raise ValueError("boom while stopping")
        finally:
            open(ready, "w").close()
            time.sleep(60)     # interrupted here: a KeyboardInterrupt on top of the ValueError
    while True:
        time.sleep(0.1)


def sleep_forever() -> None:
    while True:
        time.sleep(0.5)


def report_env(tag: str) -> dict:
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
    return {"tag": tag, "pid": os.getpid(), **{k: os.environ.get(k) for k in keys}}
