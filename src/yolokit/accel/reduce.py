"""What the processes computed, summed: gradients, and BatchNorm running statistics.

Each process backpropagates its own micro-batches with no communication; before the
optimizer step, :func:`all_reduce_gradients` sums the gradients over all processes in
a few bucketed all-reduces (no overlap with the backward, so an out-of-memory error in
any backward can still be retried). The sum over processes of the gradients of their
micro-batches is what one process would hold after accumulating all of them.

BatchNorm layers in train mode also update their running statistics once per forward:
``s <- (1 - m) s + m x``. One process that runs the micro-batches of ranks 0, 1, ...,
N - 1 one after another ends with::

    s' = a^K s + sum_r a^(K_r+) (s_r - a^(k_r) s)        a = 1 - m

where ``s`` is the value when the step began, ``s_r`` rank r's value after its ``k_r``
updates, ``K`` the total number of updates and ``K_r+`` those of the ranks after r.
:class:`BatchNormSync` computes exactly that, so every rank holds the running statistics
the one process would hold. Layers with ``momentum=None`` (a cumulative average) get the
mean over ranks instead. ``SyncBatchNorm`` layers are left alone: they normalise with the
statistics of all ranks' batches and update their running statistics identically on
every rank already.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from yolokit.accel.distributed import all_ranks_agree
from yolokit.accel.oom import free_memory, is_oom_error

DEFAULT_BUCKET_MB = 32.0


def _place(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world) as given, else the process group's ((0, 1) without one)."""
    grouped = dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if grouped else 0
    if world_size is None:
        world_size = dist.get_world_size() if grouped else 1
    return rank, world_size


def all_reduce_gradients(params: list[nn.Parameter], *, world_size: int | None = None,
                         bucket_mb: float = DEFAULT_BUCKET_MB) -> None:
    """Replace every gradient by its sum over all processes (a no-op in one process).

    Parameters whose gradient is ``None`` take part with zeros (and keep the summed
    gradient), so ranks that ran nothing, or did not use a parameter, stay in step.
    Gradients are packed into flat buckets of about ``bucket_mb`` MB per dtype; all
    buckets are sent before the first is awaited. The buffers are allocated before any
    collective starts, and the ranks agree (a tiny all-reduce on the host) that all of them
    could: when one ran out of memory, every rank sums the gradients in place instead,
    one by one, with no extra memory, rather than one rank raising while the others wait.

    Args:
        params: The parameters, in the same order on every rank.
        world_size: Number of processes; default: the process group's.
        bucket_mb: Size of one flat buffer (the only extra memory used).
    """
    if _place(0, world_size)[1] == 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    limit = bucket_mb * 2**20
    buckets: list[list[Tensor]] = []
    sizes: dict[tuple, float] = {}
    open_bucket: dict[tuple, list[Tensor]] = {}
    for p in params:
        g = p.grad
        key = (g.dtype, g.device)
        if key not in open_bucket or sizes[key] + g.numel() * g.element_size() > limit:
            open_bucket[key] = []
            buckets.append(open_bucket[key])
            sizes[key] = 0.0
        open_bucket[key].append(g)
        sizes[key] += g.numel() * g.element_size()
    try:                              # every bucket's buffer before the first collective
        flats = [torch.cat([g.reshape(-1) for g in grads]) for grads in buckets]
    except Exception as exc:
        if not is_oom_error(exc):
            raise
        flats = None                  # leaving the except block frees what was allocated
    if not all_ranks_agree(flats is not None):   # one rank out of memory: all take the same path
        del flats
        free_memory()
        for p in params:              # no extra memory: each gradient summed in place
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)     # dense in any memory format
        return
    pending = [(grads, flat, dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True))
               for grads, flat in zip(buckets, flats, strict=True)]
    for grads, flat, work in pending:
        work.wait()
        views = [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in grads]), grads, strict=True)]
        torch._foreach_copy_(grads, views)


def _batchnorms(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """BatchNorm layers with running statistics of their own process (not SyncBatchNorm)."""
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
            and not isinstance(m, nn.SyncBatchNorm) and m.track_running_stats and m.running_mean is not None]


class BatchNormSync:
    """Keeps BatchNorm running statistics identical on every rank, as one process would have them.

    Call :meth:`mark` when an optimizer step begins (before its first forward) and
    :meth:`combine` when all of its micro-batches have run on every rank; every rank
    then holds the statistics that one process would hold after running rank 0's
    micro-batches, then rank 1's, and so on (see the module docstring). Costs one copy
    of the running statistics per step and two small all-reduces (none in one process).
    :meth:`restore` puts back the values of :meth:`mark`, in one process too: a step run
    again after out-of-memory, or dropped when training is interrupted, leaves no trace in
    the statistics.

    Args:
        model: The model (plain or compiled: its modules are searched).
        rank: This process's rank; default: the process group's.
        world_size: Number of processes; default: the process group's.
    """

    def __init__(self, model: nn.Module, *, rank: int | None = None, world_size: int | None = None) -> None:
        self.rank, self.world_size = _place(rank, world_size)
        self.layers = _batchnorms(model)
        self.stats = [t for m in self.layers for t in (m.running_mean, m.running_var)]
        self.counters = [m.num_batches_tracked for m in self.layers]
        self._start: Tensor | None = None  # flat copy of the statistics when the step began
        self._start_counts: Tensor | None = None
        if self.layers:
            sizes = [t.numel() for t in self.stats]
            layer_of = torch.arange(len(self.layers)).repeat_interleave(2)
            self._layer_of = layer_of.repeat_interleave(torch.tensor(sizes)).to(self.stats[0].device)
            momentum = [m.momentum if m.momentum is not None else -1.0 for m in self.layers]
            self._momentum = torch.tensor(momentum, dtype=torch.float64, device=self.stats[0].device)

    def mark(self) -> None:
        """Remember the statistics at the start of an optimizer step."""
        if not self.layers:
            return
        with torch.no_grad():
            self._start = torch.cat([t.reshape(-1) for t in self.stats])
            self._start_counts = torch.stack(self.counters)

    def restore(self) -> None:
        """Put back the statistics of :meth:`mark` (before micro-batches are run again)."""
        if self._start is None:
            return
        with torch.no_grad():
            views = self._start.split([t.numel() for t in self.stats])
            torch._foreach_copy_(self.stats, [v.view_as(t) for v, t in zip(views, self.stats, strict=True)])
            torch._foreach_copy_(self.counters, list(self._start_counts.unbind()))

    @torch.no_grad()
    def combine(self) -> None:
        """Set every rank's statistics to the one-process sequence of all ranks' updates."""
        if self.world_size == 1 or not self.layers:
            return
        if self._start is None:
            raise RuntimeError("BatchNormSync.combine() without mark() at the start of the step")
        rank, world = self.rank, self.world_size
        start, dtype = self._start, self._start.dtype
        counts = torch.zeros(world, len(self.layers), dtype=torch.float64, device=start.device)
        counts[rank] = (torch.stack(self.counters) - self._start_counts).to(torch.float64)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)       # [N, L] updates per rank and layer
        total = counts.sum(0)                                # K per layer
        after = total - counts[: rank + 1].sum(0)            # K_r+: updates of the later ranks
        cumulative = self._momentum < 0
        keep = torch.where(cumulative, 1.0, 1.0 - self._momentum)  # a per layer
        now = torch.cat([t.reshape(-1) for t in self.stats])
        a = keep[self._layer_of]
        mine = (a ** counts[rank][self._layer_of]).to(dtype)
        later = (a ** after[self._layer_of]).to(dtype)
        part = later * (now - mine * start)
        # momentum=None layers: the mean of the ranks' values, start + mean(s_r - s)
        mean_part = (now - start) / world
        part = torch.where(cumulative[self._layer_of], mean_part, part)
        dist.all_reduce(part, op=dist.ReduceOp.SUM)
        base = torch.where(cumulative[self._layer_of], start, (a ** total[self._layer_of]).to(dtype) * start)
        new = base + part
        views = new.split([t.numel() for t in self.stats])
        torch._foreach_copy_(self.stats, [v.view_as(t) for v, t in zip(views, self.stats, strict=True)])
        torch._foreach_copy_(self.counters, list((self._start_counts + total.to(torch.long)).unbind()))
