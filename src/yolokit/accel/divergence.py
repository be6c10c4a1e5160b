"""The one divergence watchdog: training stops when its losses or gradients stay inf/NaN.

Two things go wrong the same way: a loss that is not finite (the batch's update is left
out), and an optimizer step skipped because a gradient was inf/NaN. Either one, a few
times in a row, is noise; many times in a row, the run has diverged and continuing only
burns time. :class:`Watchdog` reads both runs (the trainer's count of non-finite losses,
and :meth:`yolokit.accel.amp.Precision.check`'s skipped steps, where an fp16 loss scale
that is still settling does not count) and raises :class:`TrainingDiverged` once either
reaches ``max_bad_steps``.
"""

from __future__ import annotations

from dataclasses import dataclass


class TrainingDiverged(RuntimeError):
    """Training produced inf/NaN for too long (see :class:`Watchdog`)."""


@dataclass(frozen=True)
class Watchdog:
    """Stops a run whose losses or gradients stay non-finite for ``max_bad_steps`` steps in a row.

    Args:
        max_bad_steps: Consecutive bad steps (a non-finite loss, or a step skipped for inf/NaN
            gradients) that end the run; 0 never ends it.

    Examples:
        >>> Watchdog(10).check(bad_losses=3, skipped_steps=9)   # fine
        >>> Watchdog(10).check(bad_losses=10, skipped_steps=0)
        Traceback (most recent call last):
        ...
        yolokit.accel.divergence.TrainingDiverged: the loss was not finite for 10 steps in a row; stopped.
    """

    max_bad_steps: int = 10

    def check(self, *, bad_losses: int, skipped_steps: int, where: str = "", advice: str = "") -> None:
        """Raise :class:`TrainingDiverged` when either run reached the limit.

        Args:
            bad_losses: The longest run of consecutive non-finite losses.
            skipped_steps: The longest run of consecutive steps skipped for inf/NaN gradients.
            where: Said after what went wrong (" in epoch 3").
            advice: The message's last sentence (where the last good checkpoint is, what to try).
        """
        if not self.max_bad_steps:
            return
        if bad_losses >= self.max_bad_steps:
            what = f"the loss was not finite for {bad_losses} steps in a row"
        elif skipped_steps >= self.max_bad_steps:
            what = f"{skipped_steps} optimizer steps in a row were skipped for inf/NaN gradients"
        else:
            return
        raise TrainingDiverged(f"{what}{where}; stopped." + (f" {advice}" if advice else ""))
