"""accel: tools that make training fast, each usable on its own in a plain PyTorch loop.

Imports torch only. Modules: :mod:`~yolokit.accel.amp` (mixed precision),
:mod:`~yolokit.accel.divergence` (the watchdog that stops a diverged run),
:mod:`~yolokit.accel.checkpointing` (activation checkpointing),
:mod:`~yolokit.accel.accumulation` (accumulation and the gradient sync over processes),
:mod:`~yolokit.accel.reduce` (gradients and BatchNorm statistics summed over processes),
:mod:`~yolokit.accel.oom` (out of memory mid-run: split and replay, step retry),
:mod:`~yolokit.accel.split` (micro-batches), :mod:`~yolokit.accel.distributed` (process
group, PyTorch's DDP wrapper), :mod:`~yolokit.accel.launcher` (start processes),
:mod:`~yolokit.accel.agreement` (what the ranks decide together each step),
:mod:`~yolokit.accel.stop` (Ctrl-C and SIGTERM as a stop at a step boundary),
:mod:`~yolokit.accel.batch_size` (batch-size finder), :mod:`~yolokit.accel.perf` (speed
switches), :mod:`~yolokit.accel.devices` (device names), :mod:`~yolokit.accel.monitor`
(device readings), :mod:`~yolokit.accel.musgd` (YOLO26's MuSGD optimizer and its groups),
:mod:`~yolokit.accel.graphs` (a whole training step recorded as a CUDA graph and replayed).
"""

from yolokit.accel import distributed
from yolokit.accel.accumulation import Accumulator, accumulation_steps
from yolokit.accel.agreement import RankExchange
from yolokit.accel.amp import Precision, resolve_precision
from yolokit.accel.batch_size import find_batch_size, predict_batch_size
from yolokit.accel.checkpointing import disable_activation_checkpointing, enable_activation_checkpointing
from yolokit.accel.divergence import TrainingDiverged, Watchdog
from yolokit.accel.graphs import StepGraphs
from yolokit.accel.launcher import LaunchError, launch
from yolokit.accel.monitor import DeviceMonitor
from yolokit.accel.musgd import MuSGD, musgd_param_groups
from yolokit.accel.oom import is_oom_error, retry_step, run_batch
from yolokit.accel.perf import configure, prepare_model
from yolokit.accel.reduce import BatchNormSync, all_reduce_gradients
from yolokit.accel.split import split_batch
from yolokit.accel.stop import GracefulStop, Interrupted

__all__ = [
    "Accumulator",
    "BatchNormSync",
    "DeviceMonitor",
    "GracefulStop",
    "Interrupted",
    "LaunchError",
    "MuSGD",
    "Precision",
    "RankExchange",
    "StepGraphs",
    "TrainingDiverged",
    "Watchdog",
    "accumulation_steps",
    "all_reduce_gradients",
    "configure",
    "disable_activation_checkpointing",
    "distributed",
    "enable_activation_checkpointing",
    "find_batch_size",
    "is_oom_error",
    "launch",
    "musgd_param_groups",
    "predict_batch_size",
    "prepare_model",
    "resolve_precision",
    "retry_step",
    "run_batch",
    "split_batch",
]
