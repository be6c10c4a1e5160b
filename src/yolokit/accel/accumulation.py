"""Micro-batching with one owner: accumulation, synchronisation, the split on OOM, the loss weight.

:class:`Accumulator` decides everything about the micro-batches of an optimizer step:

- how many loader batches one step accumulates (``steps``, towards ``nominal_batch``
  images over all processes), and when the step is due (:meth:`should_step`);
- the weight each micro-batch's loss is multiplied by (passed to your function);
- synchronisation: every backward runs locally (under DDP's ``no_sync`` when the model
  is DDP-wrapped); when the step is due, gradients are summed over the processes in a
  few bucketed all-reduces and BatchNorm running statistics are combined as one
  process would have updated them (:mod:`yolokit.accel.reduce`), so N processes take
  exactly the step one process takes over the same micro-batches;
- uneven shards: :meth:`start_epoch` learns how many batches each rank has, and a rank
  whose shard ended joins the other ranks' last steps with nothing of its own;
- resuming inside an epoch: ``start_epoch(batches, first_step=k)`` continues after the
  epoch's first ``k`` steps; :meth:`rewind` drops a step in progress (gradients, and the
  BatchNorm running statistics its forwards changed) so an interrupted run can be saved
  as it was after its last completed step;
- out of memory (in forward or backward, at any micro-batch): the step's gradients are
  dropped, the micro-batch is halved, and the step's loader batches are run again at the
  new split. Nothing is copied while no error happens (earlier batches of the step are
  kept by reference: give :meth:`run` the batch as the loader returns it, on the host,
  and move it to the device inside your function). An error in ``optimizer.step`` is
  retried too (:meth:`step`).

The loop::

    acc = Accumulator(model, nominal_batch=64, batch_size=16)      # 16 images per loader batch here
    for epoch in range(epochs):
        acc.start_epoch(len(loader))
        for batch in loader:
            def forward_backward(micro, weight):                    # forward + backward of one micro-batch
                with precision.autocast():
                    loss, parts = criterion(model(micro["images"].to(device)), micro["targets"].to(device))
                precision.backward(loss * weight)
            acc.run(forward_backward, batch)
            if acc.should_step():                                   # gradients summed over processes
                acc.step(optimizer, lambda: precision.step(optimizer, clip_grad_norm=10.0))
                optimizer.zero_grad(set_to_none=True)
        while acc.should_step():                                    # steps other ranks still take
            acc.step(optimizer, lambda: precision.step(optimizer, clip_grad_norm=10.0))
            optimizer.zero_grad(set_to_none=True)
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from yolokit.accel.batch_size import free_memory, is_oom_error
from yolokit.accel.distributed import host_group
from yolokit.accel.reduce import BatchNormSync, all_reduce_gradients
from yolokit.accel.split import batch_len as _batch_len
from yolokit.accel.split import split_batch

REDUCTIONS = ("mean", "sum")


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def accumulation_steps(nominal_batch: int, batch_size: int, world_size: int = 1) -> int:
    """Loader batches per process per optimizer step: ``max(1, round(nominal_batch / (batch_size * world_size)))``.

    The one formula: :class:`Accumulator` and the trainer's runtime plan both use it.

    Example:
        >>> accumulation_steps(64, 16), accumulation_steps(64, 16, 2), accumulation_steps(64, 48)
        (4, 2, 1)
    """
    if nominal_batch < 1 or batch_size < 1 or world_size < 1:
        raise ValueError("nominal_batch, batch_size and world_size must be >= 1, got "
                         f"{nominal_batch}, {batch_size}, {world_size}")
    return max(1, round(nominal_batch / (batch_size * world_size)))


class Accumulator:
    """The owner of an optimizer step's micro-batches (see the module docstring).

    Args:
        model: The model being trained, on its device (plain, DDP-wrapped or compiled).
            Build the Accumulator after moving the model.
        nominal_batch: Images one optimizer step should represent, over all processes.
        batch_size: Images per loader batch on this process.
        world_size: Number of processes; default: the process group's (1 without one).
        reduction: How micro-batch losses add up. ``"mean"``: ``weight = images /
            effective_batch``, so a loss that is a mean over its images gives the gradient of
            the mean over the step's images. ``"sum"``: ``weight = images`` (Ultralytics'
            ``loss * batch_size``; the trainer's choice, so YOLOv8 SGD learning rates keep
            their meaning).
        min_micro_batch: Re-raise an out-of-memory error rather than split below this.

    Attributes:
        steps: Loader batches per optimizer step on each process,
            ``max(1, round(nominal_batch / (batch_size * world_size)))`` (:func:`accumulation_steps`).
        splits: Micro-batches each loader batch is cut into (grows on out-of-memory).
        recoveries: Out-of-memory errors recovered from so far.
        step_retries: Optimizer steps retried after out-of-memory (see :meth:`resync`).

    Example:
        >>> acc = Accumulator(nn.Linear(2, 1), nominal_batch=64, batch_size=16)
        >>> acc.steps, acc.effective_batch, acc.loss_weight(16)
        (4, 64, 0.25)
    """

    def __init__(self, model: nn.Module, *, nominal_batch: int, batch_size: int, world_size: int | None = None,
                 reduction: str = "mean", min_micro_batch: int = 1) -> None:
        world = _world()[1] if world_size is None else world_size
        self.steps = accumulation_steps(nominal_batch, batch_size, world)
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        self.model, self.batch_size, self.world_size = model, batch_size, world
        self.reduction, self.min_micro_batch = reduction, min_micro_batch
        self.splits, self.recoveries, self.step_retries = 1, 0, 0
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.batchnorm = BatchNormSync(model)
        self._held: list[Any] = []        # this step's loader batches, for a replay after OOM
        self._mine: int | None = None     # this rank's loader batches this epoch (from _first on)
        self._epoch_steps: int | None = None  # optimizer steps every rank takes this epoch
        self._first = 0                   # steps of this epoch taken before start_epoch (a resume)
        self._step_index = 0              # optimizer steps made due this epoch

    def __repr__(self) -> str:
        return (f"Accumulator(steps={self.steps}, effective_batch={self.effective_batch}, "
                f"reduction={self.reduction!r}, splits={self.splits})")

    @property
    def effective_batch(self) -> int:
        """Images per optimizer step over all processes (nominal: the last step of an epoch may hold fewer)."""
        return self.steps * self.batch_size * self.world_size

    def loss_weight(self, images: int) -> float:
        """Factor for the loss of a micro-batch of ``images`` images (see ``reduction``)."""
        return float(images) if self.reduction == "sum" else images / self.effective_batch

    @property
    def pending(self) -> int:
        """Loader batches run since the last optimizer step."""
        return len(self._held)

    def state_dict(self) -> dict[str, int]:
        """The split reached after out-of-memory errors (for a checkpoint)."""
        return {"splits": self.splits, "recoveries": self.recoveries}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.splits, self.recoveries = int(state.get("splits", 1)), int(state.get("recoveries", 0))

    # --- an epoch --------------------------------------------------------------------------

    def start_epoch(self, batches: int, *, first_step: int = 0, epoch_steps: int | None = None) -> None:
        """Start an epoch in which this process will run ``batches`` loader batches.

        Ranks may have different counts (uneven shards); every rank then takes
        ``max over ranks of ceil(batches / steps)`` optimizer steps, and a rank with
        fewer batches contributes nothing to the steps it has no batches for. That count
        is ``epoch_steps`` when the caller knows it (the trainer's runtime plan does);
        otherwise one tiny all-gather works it out. Pending micro-batches of an unfinished
        step are an error.

        Args:
            batches: Loader batches this process runs in the epoch, from ``first_step`` on.
            first_step: Optimizer steps of the epoch already taken (resuming from a
                checkpoint written at a step boundary); :attr:`step_index` starts there.
            epoch_steps: Optimizer steps of the whole epoch (``first_step`` included), the
                same on every rank; checked against ``batches``.
        """
        if self._held:
            raise RuntimeError(f"{len(self._held)} loader batches are still waiting for an optimizer step")
        self._mine, self._first = int(batches), int(first_step)
        if epoch_steps is None:
            counts = [self._mine] * self.world_size
            if self.world_size > 1:
                dist.all_gather_object(counts, self._mine)   # fills in every rank's count
            epoch_steps = self._first + max(math.ceil(n / self.steps) for n in counts)
        elif self._first + math.ceil(self._mine / self.steps) > epoch_steps:
            raise ValueError(f"{batches} loader batches from step {first_step} on need more than the epoch's "
                             f"{epoch_steps} optimizer steps of {self.steps} batches")
        self._epoch_steps, self._step_index = int(epoch_steps), self._first

    @property
    def epoch_steps(self) -> int | None:
        """Optimizer steps every rank takes this epoch (None before :meth:`start_epoch`)."""
        return self._epoch_steps

    @property
    def step_index(self) -> int:
        """Optimizer steps made due this epoch (by :meth:`should_step`)."""
        return self._step_index

    def _batches_this_step(self) -> int:
        """Loader batches this rank runs in the current step."""
        if self._mine is None:
            return self.steps
        return max(0, min(self.steps, self._mine - (self._step_index - self._first) * self.steps))

    # --- micro-batches -------------------------------------------------------------------

    def run(self, fn: Callable[[Any, float], Any], batch: Any) -> list[Any]:
        """Forward and backward of one loader batch, as ``splits`` micro-batches.

        Args:
            fn: ``fn(micro_batch, weight)`` runs the forward and backward of a micro-batch
                with its loss multiplied by ``weight``; its return value is collected.
            batch: One loader batch (a Tensor[B, ...], a batch dict, or a tuple of fields;
                see :func:`split_batch`).

        Returns:
            What ``fn`` returned, one value per micro-batch of this batch.
        """
        if not self._held:
            self.batchnorm.mark()
        replay: list[Any] = []
        while True:
            try:
                for held in replay:       # after a recovery: the step's earlier batches again
                    self._run_split(fn, held)
                out = self._run_split(fn, batch)
                break
            except Exception as exc:
                if not is_oom_error(exc) or self._micro_size(batch) <= self.min_micro_batch:
                    raise
            self._recover(batch)
            replay = self._held
        self._held.append(batch)
        return out

    def _micro_size(self, batch: Any) -> int:
        return math.ceil(_batch_len(batch) / self.splits)

    def _run_split(self, fn: Callable[[Any, float], Any], batch: Any) -> list[Any]:
        with _no_sync(self.model):
            return [fn(micro, self.loss_weight(_batch_len(micro))) for micro in split_batch(batch, self.splits)]

    def rewind(self) -> None:
        """Drop the optimizer step in progress: its gradients, its loader batches, and what
        its forwards did to BatchNorm running statistics (back to their values when the step
        began). Afterwards the model is as its last completed :meth:`step` left it."""
        for p in self.params:
            p.grad = None
        self.batchnorm.restore()
        self.batchnorm.release()
        self._held.clear()

    def _recover(self, batch: Any) -> None:
        for p in self.params:
            p.grad = None
        self.batchnorm.restore()
        free_memory()
        self.splits *= 2
        self.recoveries += 1
        warnings.warn(
            f"out of memory: running the step's {len(self._held) + 1} loader batch(es) again as "
            f"{self.splits} micro-batches of <= {self._micro_size(batch)} images each (effective batch unchanged)",
            RuntimeWarning, stacklevel=3)

    # --- the optimizer step --------------------------------------------------------------

    def should_step(self) -> bool:
        """True when the optimizer step is due; gradients and BatchNorm statistics are then synchronised.

        Due when this rank has run its batches of the current step, or, after its loader is
        exhausted, while other ranks still have steps to take this epoch (this rank then
        contributes nothing). Without :meth:`start_epoch`, due every ``steps`` batches.
        """
        due = self._batches_this_step()
        if self._epoch_steps is not None and self._step_index >= self._epoch_steps:
            return False
        if len(self._held) < due or (due == 0 and self._mine is None):
            return False
        if not self._held:
            self.batchnorm.mark()          # an empty step: nothing of ours to add
        all_reduce_gradients(self.params)
        self.batchnorm.combine()
        self._held.clear()
        self._step_index += 1
        return True

    def step(self, optimizer: torch.optim.Optimizer, step_fn: Callable[[], Any] | None = None) -> Any:
        """Run the optimizer step, retrying once after an out-of-memory error.

        On the error the allocator's cache is freed and the step runs again with the
        optimizer's multi-tensor (foreach) implementation off, which needs temporaries
        of one parameter at a time. The retry is exact when the error came before the
        optimizer changed a tensor (a foreach step allocates its temporaries first; the
        fused ones allocate none); when an Adam-style step counter shows it had already
        begun, the error is re-raised with that explanation.

        Args:
            optimizer: The optimizer stepped by ``step_fn``.
            step_fn: Runs the step (e.g. ``lambda: precision.step(optimizer, clip_grad_norm=10)``);
                default ``optimizer.step``.

        Returns:
            What ``step_fn`` returned.
        """
        step_fn = step_fn or optimizer.step
        marker = _step_marker(optimizer)
        try:
            out = step_fn()
            self.batchnorm.release()      # the step is complete: nothing to rewind to any more
            return out
        except Exception as exc:
            if not is_oom_error(exc):
                raise
            if not _same_marker(_step_marker(optimizer), marker):
                raise RuntimeError("out of memory inside optimizer.step after it had begun to update its "
                                   "state, so it cannot be retried exactly; resume from the last checkpoint "
                                   "with a smaller batch") from exc
        free_memory()
        for group in optimizer.param_groups:
            if "foreach" in group:
                group["foreach"] = False
        self.recoveries += 1
        self.step_retries += 1
        warnings.warn("out of memory in optimizer.step: retrying one parameter at a time (foreach off)",
                      RuntimeWarning, stacklevel=2)
        out = step_fn()
        self.batchnorm.release()
        return out

    def resync(self, optimizer: torch.optim.Optimizer) -> None:
        """Every rank continues as rank 0 after some rank retried :meth:`step` (see ``step_retries``).

        The retry runs the optimizer without its multi-tensor kernels, which need not round
        as the others do; so all ranks turn them off, and take rank 0's parameters, buffers
        and optimizer state. A collective: call it on every rank once the ranks agree that a
        retry happened (the trainer decides it with its per-step exchange). A no-op in one
        process.
        """
        if self.world_size == 1:
            return
        for group in optimizer.param_groups:
            if "foreach" in group:
                group["foreach"] = False
        tensors = [*self.model.parameters(), *self.model.buffers()]
        tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        nccl = dist.get_backend() == "nccl"
        with torch.no_grad():
            for t in tensors:   # host tensors (Adam's step counts) go over gloo under NCCL
                dist.broadcast(t.data, src=0, group=host_group() if nccl and t.device.type == "cpu" else None)


def _step_marker(optimizer: torch.optim.Optimizer) -> tuple[int, Any] | None:
    """What a step changes first in the state of the optimizer's first parameter.

    ``(number of state entries, a copy of the step counter)``: a first step creates the
    entries, and Adam-style optimizers count steps before anything else. Copied, not read:
    comparing happens only after an error.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            step = state.get("step")
            return len(state), step.clone() if isinstance(step, torch.Tensor) else step
    return None


def _same_marker(a: tuple[int, Any] | None, b: tuple[int, Any] | None) -> bool:
    if a is None or b is None:
        return a is b
    if a[0] != b[0] or type(a[1]) is not type(b[1]):
        return False
    return torch.equal(a[1], b[1]) if isinstance(a[1], torch.Tensor) else a[1] == b[1]


def _no_sync(model: nn.Module) -> contextlib.AbstractContextManager:
    inner = getattr(model, "_orig_mod", model)  # torch.compile around DDP, or the model itself
    return inner.no_sync() if isinstance(inner, DistributedDataParallel) else contextlib.nullcontext()
