"""Training: the config, the trainer and its step, callbacks, checkpoints, comparisons of runs.

The run (config, plan, build, step, trainer, checkpoints, callbacks) is the modules here; two
subpackages sit beside it: `yolokit.train.trackers` (W&B, MLflow, TensorBoard, CSV), callbacks the run
builds, and `yolokit.train.sweeps` (``yolokit.tune``), which trains a run per trial.

Examples:
    >>> from yolokit.train import TrainConfig, train
    >>> metrics = train(TrainConfig(model="yolov8n", data="shapes", epochs=3, imgsz=128))
"""

from yolokit.train.callbacks import Callback
from yolokit.train.compare import Comparison, RunResults, compare_runs, read_results
from yolokit.train.config import TrainConfig
from yolokit.train.entry import train
from yolokit.train.state import Parts, Progress
from yolokit.train.trainer import Trainer

__all__ = ["Callback", "Comparison", "Parts", "Progress", "RunResults", "TrainConfig", "Trainer", "compare_runs",
           "read_results", "train"]
