"""Training: config, loop, evaluation, checkpoints, callbacks."""

from yolokit.train.compare import Comparison, compare_runs
from yolokit.train.config import TrainConfig
from yolokit.train.evaluate import EvalResult, coco_evaluate, validate
from yolokit.train.trainer import Trainer, TrainingDiverged, train

__all__ = ["Comparison", "EvalResult", "TrainConfig", "Trainer", "TrainingDiverged", "coco_evaluate", "compare_runs",
           "train", "validate"]
