"""LossMeter: device sums of loss parts, and the epoch mean over every process."""

import _train_workers as workers
import pytest
import torch

from yolokit.accel.launch import launch
from yolokit.train.meter import LossMeter


def test_means_skip_non_finite_batches_and_count_the_longest_bad_run():
    meter = LossMeter(torch.device("cpu"), every=2)
    for box in (1.0, float("nan"), float("inf"), 3.0):
        meter.add([({"box": torch.tensor(box)}, 4)])
    assert meter.epoch_means() == {"box": 2.0}
    assert meter.longest_nonfinite_run() == 2
    assert [meter.due(i) for i in range(4)] == [False, True, False, True]


@pytest.mark.slow
def test_a_rank_without_batches_joins_the_epoch_mean():
    """Rank 1 had nothing this epoch (an uneven last step): it must not hang the others or
    skip the reduction; every rank reads the same means, over rank 0's batches."""
    results = launch(workers.meter_means, 2, [2, 0], timeout=120)
    assert results[0] == results[1] == {"box": 1.5, "cls": 3.0}
