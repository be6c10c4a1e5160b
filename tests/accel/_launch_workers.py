"""Functions and arguments that ``launch`` sends in the launcher's tests (spawned children import this module)."""

import os
import time
from pathlib import Path

import torch


def threaded_sum() -> float:
    """Two intra-op threads (OpenMP) in the rank, whatever its parent did with its own."""
    torch.set_num_threads(2)
    x = torch.ones(256, 256)
    return float((x * 2 + 1).sum() + (x @ x).sum())


def ready_then_sleep(folder: str) -> None:
    """Says it is running (a file named by its rank), then waits for a stop."""
    (Path(folder) / os.environ["RANK"]).touch()
    while True:
        time.sleep(0.05)


def sleep_with(argument: object) -> None:
    while True:
        time.sleep(0.05)


def _rebuilt_on_rank_zero_only() -> object:
    if os.environ["RANK"] != "0":
        raise ValueError(f"this argument cannot be rebuilt on rank {os.environ['RANK']}")
    return None


class BrokenOnRankOne:
    """An argument that pickles here and cannot be unpickled by rank 1."""

    def __reduce__(self) -> tuple:
        return _rebuilt_on_rank_zero_only, ()
