"""What every rank decides together at a step boundary: a few named integers, their max over ranks.

A stop that one process received (Ctrl-C, torchrun's SIGTERM), a loss that stays non-finite
on one rank, an optimizer step one rank had to retry after out of memory: all processes
must act on it at the same optimizer step, or some would wait in a collective for ever.
:class:`RankExchange` is that agreement, written once: each rank proposes a dataclass of
integers at every step boundary, and gets back their max over the ranks.

The exchange runs on the host (a gloo group; its own one under NCCL), without waiting:
what the ranks propose at boundary k is decided at boundary k + 1, so nothing waits for
the accelerator or for a slower rank, and every rank answers the same, one step late. In
one process the answer is the proposal itself, at once.

Example::

    @dataclass(frozen=True)
    class Votes:
        signal: int = 0
        bad_losses: int = 0

    exchange = RankExchange(Votes, world_size=world)
    decided = exchange(Votes(signal=stop.received or 0, bad_losses=bad))
    if decided.signal:
        raise Interrupted(decided.signal)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from yolokit.accel.distributed import all_gather_object, all_ranks_agree, host_group

T = TypeVar("T")


class RankExchange(Generic[T]):
    """The max over ranks of a dataclass of integers, exchanged once per step boundary (see the module).

    Args:
        votes: The dataclass of integer fields (every field has a default of 0).
        world_size: Number of processes; with 1 nothing is exchanged.

    Call it on every rank at every boundary, the same number of times; :meth:`close` (or the
    ``with`` block's end) waits for the last exchange when training ends normally.
    """

    def __init__(self, votes: type[T], *, world_size: int) -> None:
        self.votes, self.world_size = votes, world_size
        self._names = [f.name for f in dataclasses.fields(votes)]
        self._flat = torch.zeros(len(self._names), dtype=torch.int64)
        self._work: Any = None

    def __call__(self, proposal: T) -> T:
        """This rank's proposal in, the decision out (several processes: on the proposals of the last call)."""
        values = [int(getattr(proposal, name)) for name in self._names]
        if self.world_size == 1:
            return self.votes(**dict(zip(self._names, values, strict=True)))
        decided = [0] * len(values)
        if self._work is not None:
            self._work.wait()
            decided = self._flat.tolist()               # a CPU tensor: no device read
        self._flat = torch.tensor(values, dtype=torch.int64)
        self._work = dist.all_reduce(self._flat, op=dist.ReduceOp.MAX, group=host_group(), async_op=True)
        return self.votes(**dict(zip(self._names, decided, strict=True)))

    def close(self) -> None:
        """Wait for the exchange in flight (every rank started it); call when training ended normally."""
        if self._work is not None:
            self._work.wait()
        self._work = None

    def __enter__(self) -> RankExchange[T]:
        return self

    def __exit__(self, kind: Any, *exc: Any) -> None:
        if kind is None:
            self.close()
        self._work = None


def first_failure(message: str | None) -> tuple[int, str] | None:
    """What failed on some rank, agreed at once: every rank calls it at the same point, with a message when
    it cannot go on (its data stopped) and None when it can. Returns None when no rank failed, else the
    lowest failing rank and its message, the same on every rank (a blocking all-reduce, and a gather
    only after a failure). In one process: ``(0, message)`` or None."""
    if all_ranks_agree(message is None):
        return None
    said = all_gather_object(message)
    rank = next(r for r, m in enumerate(said) if m is not None)
    return rank, said[rank]
