"""LossMeter: device sums of loss parts, and the epoch mean over every process."""

import _train_workers as workers
import pytest
import torch

from yolokit.accel.launcher import launch
from yolokit.train.meter import LossMeter


def test_means_skip_non_finite_batches_and_count_the_longest_bad_run():
    meter = LossMeter(torch.device("cpu"), every=2)
    for box in (1.0, float("nan"), float("inf"), 3.0):
        meter.add([({"box": torch.tensor(box)}, 4)])
    assert meter.epoch_means() == {"box": 2.0}
    assert meter.longest_nonfinite_run() == 2
    assert [meter.due(i) for i in range(4)] == [False, True, False, True]


@pytest.mark.slow
@pytest.mark.usefixtures("forked_ranks")
def test_a_rank_without_batches_joins_the_epoch_mean():
    """Rank 1 had nothing this epoch (an uneven last step): it must not hang the others or
    skip the reduction; every rank reads the same means, over rank 0's batches."""
    results = launch(workers.meter_means, 2, [2, 0], timeout=120)
    assert results[0] == results[1] == {"box": 1.5, "cls": 3.0}


def test_take_recent_is_the_mean_of_the_finite_batches_since_the_last_take_as_last_read():
    meter = LossMeter(torch.device("cpu"), every=1)
    assert meter.take_recent() == {}                              # nothing read yet
    for box in (1.0, 3.0):
        meter.add([({"box": torch.tensor(box), "cls": torch.tensor(2 * box)}, 4)])
    meter.longest_nonfinite_run()                                 # a read point
    assert meter.take_recent() == {"box": 2.0, "cls": 4.0}
    assert meter.take_recent() == {}                              # no batch since
    meter.add([({"box": torch.tensor(float("nan")), "cls": torch.tensor(1.0)}, 4)])
    meter.add([({"box": torch.tensor(7.0), "cls": torch.tensor(1.0)}, 4)])
    assert meter.take_recent() == {}                              # not read yet: as of the last read
    meter.longest_nonfinite_run()
    assert meter.take_recent() == {"box": 7.0, "cls": 1.0}        # the NaN batch is left out
    meter.mark()
    resumed = LossMeter(torch.device("cpu"), every=1)             # a resume continues after the saved sums
    resumed.load_state_dict(meter.state_dict())
    resumed.add([({"box": torch.tensor(5.0), "cls": torch.tensor(0.5)}, 4)])
    resumed.longest_nonfinite_run()
    assert resumed.take_recent() == {"box": 5.0, "cls": 0.5}
