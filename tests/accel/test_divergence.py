"""The one divergence watchdog: non-finite losses and skipped steps against one limit."""

import pytest

from yolokit.accel.divergence import TrainingDiverged, Watchdog


def test_either_run_at_the_limit_stops_and_says_which():
    dog = Watchdog(max_bad_steps=3)
    dog.check(bad_losses=2, skipped_steps=2)                     # below the limit: nothing
    with pytest.raises(TrainingDiverged, match=r"^the loss was not finite for 3 steps in a row in epoch 2; "
                                                r"stopped\. The last good checkpoint is x$"):
        dog.check(bad_losses=3, skipped_steps=0, where=" in epoch 2", advice="The last good checkpoint is x")
    with pytest.raises(TrainingDiverged, match="5 optimizer steps in a row were skipped for inf/NaN gradients"):
        dog.check(bad_losses=0, skipped_steps=5)


def test_zero_never_stops():
    Watchdog(max_bad_steps=0).check(bad_losses=10**6, skipped_steps=10**6)
