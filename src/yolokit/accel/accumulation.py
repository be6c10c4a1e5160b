"""Gradient accumulation over loader batches and processes, with the sync as an explicit call.

An optimizer step accumulates ``accumulate`` loader batches on each of ``world_size``
processes. Every backward runs locally, with no communication; when the step is due
(:meth:`Accumulator.step_due`, a pure question), :meth:`Accumulator.sync` sums the
gradients over the processes in a few bucketed all-reduces and combines the BatchNorm
running statistics as one process would have updated them (:mod:`yolokit.accel.reduce`).
N processes therefore take exactly the step one process takes over the same micro-batches.
This is yolokit's way of training on several processes; a model wrapped in PyTorch's
``DistributedDataParallel`` (``distributed.wrap_ddp``, with ``distributed.no_sync`` while
accumulating) is the usual alternative and must not be given to an Accumulator.

Uneven shards: :meth:`Accumulator.start_epoch` learns how many loader batches this rank
runs and how many steps every rank takes; a rank whose shard ended joins the other ranks'
last steps with nothing of its own (its step is due at once). Resuming inside an epoch:
``start_epoch(batches, epoch_steps=n, first_step=k)``. Out of memory: the Accumulator
keeps the step's loader batches (``held``) and its micro-batch split; what happens on the
error is :mod:`yolokit.accel.oom`.

The loop::

    acc = Accumulator(model, accumulate=accumulation_steps(64, 16, world))   # 16 images per batch
    for epoch in range(epochs):
        acc.start_epoch(len(loader))
        for batch in loader:
            for micro in acc.micro_batches(batch):
                with precision.autocast():
                    loss, _ = criterion(model(micro["images"]), micro["targets"])
                precision.backward(loss * len(micro["images"]))
            acc.ran(batch)
            if acc.step_due():
                acc.sync()                            # gradients summed over the processes
                precision.step(optimizer, clip_grad_norm=10.0)
                optimizer.zero_grad(set_to_none=True)
        while acc.step_due():                         # uneven shards: the other ranks' last steps
            ...                                       # the same sync and step, with nothing of ours
"""

from __future__ import annotations

import math
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from yolokit.accel.reduce import BatchNormSync, all_reduce_gradients
from yolokit.accel.split import batch_len, split_batch


def accumulation_steps(nominal_batch: int, batch_size: int, world_size: int = 1) -> int:
    """Loader batches per process per optimizer step: ``max(1, round(nominal_batch / (batch_size * world_size)))``.

    The one formula: the trainer's runtime plan works it out once with it.

    Examples:
        >>> accumulation_steps(64, 16), accumulation_steps(64, 16, 2), accumulation_steps(64, 48)
        (4, 2, 1)
    """
    if nominal_batch < 1 or batch_size < 1 or world_size < 1:
        raise ValueError("nominal_batch, batch_size and world_size must be >= 1, got "
                         f"{nominal_batch}, {batch_size}, {world_size}")
    return max(1, round(nominal_batch / (batch_size * world_size)))


class Accumulator:
    """When an optimizer step is due, and the gradient sync before it (see the module docstring).

    Args:
        model: The model being trained, on its device (plain or compiled, not DDP-wrapped).
            Build the Accumulator after moving the model.
        accumulate: Loader batches per process per optimizer step.
        rank: This process's rank; default: the process group's (0 without one).
        world_size: Number of processes; default: the process group's (1 without one).
        min_micro_batch: After out of memory, re-raise rather than split below this many images.

    Attributes:
        held: The current step's loader batches that have run (for a replay after out of memory).
        splits: Micro-batches each loader batch is cut into (doubles on out of memory).
        recoveries: Out-of-memory errors recovered from so far.
        step_retries: Optimizer steps retried after out of memory (:func:`yolokit.accel.oom.retry_step`).

    Examples:
        >>> acc = Accumulator(nn.Linear(2, 1), accumulate=4)
        >>> acc.accumulate, acc.world_size, acc.step_due()
        (4, 1, False)
    """

    def __init__(self, model: nn.Module, *, accumulate: int, rank: int | None = None, world_size: int | None = None,
                 min_micro_batch: int = 1) -> None:
        if isinstance(getattr(model, "_orig_mod", model), DistributedDataParallel):   # also under torch.compile
            raise TypeError("the Accumulator sums gradients itself: give it the plain model, not a DDP-wrapped "
                            "one (or train the DDP model with distributed.no_sync while accumulating)")
        if accumulate < 1:
            raise ValueError(f"accumulate must be >= 1, got {accumulate}")
        grouped = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if grouped else 0)
        self.world_size = world_size if world_size is not None else (dist.get_world_size() if grouped else 1)
        self.model, self.accumulate, self.min_micro_batch = model, int(accumulate), min_micro_batch
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.batchnorm = BatchNormSync(model, rank=self.rank, world_size=self.world_size)
        self.splits, self.recoveries, self.step_retries = 1, 0, 0
        self.held: list[Any] = []
        self._mine: int | None = None     # this rank's loader batches this epoch (from _first on)
        self._epoch_steps: int | None = None  # optimizer steps every rank takes this epoch
        self._first = 0                   # steps of this epoch taken before start_epoch (a resume)
        self._step_index = 0              # optimizer steps synced this epoch
        self.batchnorm.mark()

    def __repr__(self) -> str:
        return (f"Accumulator(accumulate={self.accumulate}, rank={self.rank}, world_size={self.world_size}, "
                f"splits={self.splits})")

    def state_dict(self) -> dict[str, int]:
        """The split reached after out-of-memory errors (for a checkpoint)."""
        return {"splits": self.splits, "recoveries": self.recoveries}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.splits, self.recoveries = int(state.get("splits", 1)), int(state.get("recoveries", 0))

    # --- an epoch --------------------------------------------------------------------------

    def start_epoch(self, batches: int, *, epoch_steps: int | None = None, first_step: int = 0) -> None:
        """Start an epoch in which this process will run ``batches`` loader batches.

        Ranks may have different counts (uneven shards); every rank then takes
        ``max over ranks of ceil(batches / accumulate)`` optimizer steps, and a rank with
        fewer batches contributes nothing to the steps it has no batches for. That count
        is ``epoch_steps`` when the caller knows it (the trainer's runtime plan does);
        otherwise one tiny all-gather works it out. Batches of an unfinished step are an error.

        Args:
            batches: Loader batches this process runs in the epoch, from ``first_step`` on.
            epoch_steps: Optimizer steps of the whole epoch (``first_step`` included), the
                same on every rank; checked against ``batches``.
            first_step: Optimizer steps of the epoch already taken (resuming from a
                checkpoint written at a step boundary).
        """
        if self.held:
            raise RuntimeError(f"{len(self.held)} loader batches are still waiting for an optimizer step")
        self._mine, self._first = int(batches), int(first_step)
        if epoch_steps is None:
            counts = [self._mine] * self.world_size
            if self.world_size > 1:
                dist.all_gather_object(counts, self._mine)   # fills in every rank's count
            epoch_steps = self._first + max(math.ceil(n / self.accumulate) for n in counts)
        elif self._first + math.ceil(self._mine / self.accumulate) > epoch_steps:
            raise ValueError(f"{batches} loader batches from step {first_step} on need more than the epoch's "
                             f"{epoch_steps} optimizer steps of {self.accumulate} batches")
        self._epoch_steps, self._step_index = int(epoch_steps), self._first
        self.batchnorm.mark()             # the statistics as the epoch begins (a resume may have loaded them)

    @property
    def steps_left(self) -> int:
        """Optimizer steps of this epoch not yet synced (0 before :meth:`start_epoch`)."""
        return 0 if self._epoch_steps is None else self._epoch_steps - self._step_index

    def _batches_this_step(self) -> int:
        """Loader batches this rank runs in the current step."""
        if self._mine is None:
            return self.accumulate
        return max(0, min(self.accumulate, self._mine - (self._step_index - self._first) * self.accumulate))

    # --- micro-batches ---------------------------------------------------------------------

    def micro_size(self, batch: Any) -> int:
        """Images in the largest micro-batch of ``batch`` at the current split."""
        return math.ceil(batch_len(batch) / self.splits)

    def micro_batches(self, batch: Any) -> list[Any]:
        """``batch`` cut into ``splits`` micro-batches (the batch itself while ``splits`` is 1)."""
        return split_batch(batch, self.splits)

    def ran(self, batch: Any) -> None:
        """``batch``'s forward and backward are done: it counts towards the step (and is kept for a replay)."""
        self.held.append(batch)

    def drop_step(self) -> None:
        """Drop the step in progress: its gradients, and what its forwards did to BatchNorm running
        statistics (back to their values when the step began). ``held`` stays (for a replay)."""
        for p in self.params:
            p.grad = None
        self.batchnorm.restore()

    def rewind(self) -> None:
        """Drop the step in progress and its loader batches: the model is as the last :meth:`sync` left it
        (an interrupted run is saved as it was after its last completed step)."""
        self.drop_step()
        self.held.clear()

    # --- the optimizer step ----------------------------------------------------------------

    def step_due(self) -> bool:
        """Whether the optimizer step is due: this rank has run its loader batches of the step.

        After this rank's shard has ended, due while the other ranks still have steps to take
        this epoch (this rank then contributes nothing). Without :meth:`start_epoch`, due
        every ``accumulate`` batches. Changes nothing.
        """
        if self._epoch_steps is not None and self._step_index >= self._epoch_steps:
            return False
        due = self._batches_this_step()
        return len(self.held) >= due and (due > 0 or self._mine is not None)

    def completes_step(self) -> bool:
        """Whether one more loader batch of this rank makes the step due (it is then the step's last).
        Changes nothing."""
        if self._epoch_steps is not None and self._step_index >= self._epoch_steps:
            return False
        return len(self.held) + 1 >= self._batches_this_step()

    def sync(self) -> None:
        """Sum the gradients over the processes and combine their BatchNorm statistics; the step is
        then counted, and the next one begins. Call it on every rank when :meth:`step_due` says so."""
        all_reduce_gradients(self.params, world_size=self.world_size)
        self.batchnorm.combine()
        self.held.clear()
        self._step_index += 1
        self.batchnorm.mark()
