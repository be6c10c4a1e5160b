"""Experiment trackers: Weights & Biases, MLflow, TensorBoard and a CSV of steps, each a
:class:`~yolokit.train.callbacks.Callback` of the run (``TrainConfig.tracker``, ``--tracker wandb,mlflow``).

`base` holds what every tracker shares (the :class:`Tracker` base, its error, the helpers that flatten a
config and name metrics), `catalog` which trackers a run has and the W&B, TensorBoard and CSV trackers,
`mlflow_tracker` the MLflow one. The layout (tests/test_architecture.py): of the run, the trackers import
only its callbacks (the hooks they implement); the run imports them in ``config`` (the names) and
``build`` (the callbacks of a run).
"""

from yolokit.train.trackers.base import Tracker, TrackerError
from yolokit.train.trackers.catalog import (
    TRACKERS,
    CSVTracker,
    TensorBoardTracker,
    WandbTracker,
    build_trackers,
    check_trackers,
    run_callbacks,
    tracker_names,
)
from yolokit.train.trackers.mlflow_tracker import MLflowTracker

__all__ = [
    "CSVTracker", "MLflowTracker", "TRACKERS", "TensorBoardTracker", "Tracker", "TrackerError", "WandbTracker",
    "build_trackers", "check_trackers", "run_callbacks", "tracker_names",
]
