"""Gradient accumulation towards a nominal batch size, with DDP ``no_sync``.

Several micro-batches are backpropagated before one optimizer step, so the step sees
the gradient of ``nominal_batch`` images while memory holds only ``batch_size``. Under
DDP the gradient all-reduce runs only on the last micro-step of each step::

    acc = Accumulator(nominal_batch=64, batch_size=16, world_size=distributed.world_size())
    for batch in loader:
        with acc.micro_step(model):                  # no_sync unless last micro-step
            with precision.autocast():
                loss, parts = criterion(model(batch["images"]), batch["targets"])
            precision.backward(loss * acc.loss_weight)
        if acc.should_step():
            precision.step(optimizer)
            optimizer.zero_grad(set_to_none=True)

With a loss that is a mean over the images of its micro-batch and equal micro-batches,
the accumulated gradient equals the gradient of one big batch (BatchNorm layers in
train mode still see micro-batch statistics).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from yolokit.accel.distributed import no_sync


class Accumulator:
    """Counts micro-steps and says when to step the optimizer.

    Args:
        nominal_batch: Batch size one optimizer step should represent, over all ranks.
        batch_size: Micro-batch size per rank.
        world_size: Number of data-parallel ranks.

    Attributes:
        steps: Micro-steps per optimizer step, ``max(1, round(nominal / (batch * world)))``.
        count: Micro-steps done since the last optimizer step.

    Example:
        >>> acc = Accumulator(64, 16)
        >>> acc.steps, acc.effective_batch, acc.loss_weight
        (4, 64, 0.25)
    """

    def __init__(self, nominal_batch: int, batch_size: int, *, world_size: int = 1) -> None:
        if nominal_batch < 1 or batch_size < 1 or world_size < 1:
            raise ValueError("nominal_batch, batch_size and world_size must be >= 1")
        self.batch_size = batch_size
        self.world_size = world_size
        self.steps = max(1, round(nominal_batch / (batch_size * world_size)))
        self.count = 0

    def __repr__(self) -> str:
        return f"Accumulator(steps={self.steps}, effective_batch={self.effective_batch})"

    @property
    def effective_batch(self) -> int:
        """Images per optimizer step over all ranks."""
        return self.steps * self.batch_size * self.world_size

    @property
    def loss_weight(self) -> float:
        """Factor for each micro-batch's mean loss, ``1 / steps``."""
        return 1.0 / self.steps

    @property
    def is_last(self) -> bool:
        """Whether the next micro-step completes an optimizer step (gradients sync)."""
        return self.count + 1 >= self.steps

    @property
    def pending(self) -> int:
        """Micro-steps accumulated but not yet stepped (flush them at the end of a run)."""
        return self.count

    @contextlib.contextmanager
    def micro_step(self, model: nn.Module) -> Iterator[None]:
        """Context for one micro-step's forward and backward.

        Args:
            model: The (possibly DDP-wrapped) model; DDP skips the all-reduce unless
                this is the last micro-step of the optimizer step.
        """
        with no_sync(model, enabled=not self.is_last):
            yield
        self.count += 1

    def reset(self) -> None:
        """Forget pending micro-steps (after stepping them early, e.g. at the end of an epoch)."""
        self.count = 0

    def should_step(self) -> bool:
        """True once every ``steps`` micro-steps; resets the count when it returns True."""
        if self.count >= self.steps:
            self.count = 0
            return True
        return False
