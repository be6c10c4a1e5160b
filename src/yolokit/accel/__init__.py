"""accel: tools that make training fast, each usable on its own in a plain PyTorch loop.

Imports torch only. Modules: :mod:`~yolokit.accel.amp` (mixed precision),
:mod:`~yolokit.accel.checkpointing` (activation checkpointing),
:mod:`~yolokit.accel.distributed` (process group, DDP, reductions),
:mod:`~yolokit.accel.launch` (start processes), :mod:`~yolokit.accel.accumulation`
(micro-batching: accumulation, synchronisation, split on OOM), :mod:`~yolokit.accel.reduce`
(gradients and BatchNorm statistics summed over processes), :mod:`~yolokit.accel.batch_size`
(batch-size finder), :mod:`~yolokit.accel.perf` (speed switches),
:mod:`~yolokit.accel.monitor` (device readings), :mod:`~yolokit.accel.stop` (Ctrl-C and SIGTERM
as a stop at a step boundary).
"""

from yolokit.accel import distributed
from yolokit.accel.accumulation import Accumulator
from yolokit.accel.amp import Precision, TrainingDiverged, check_precision, prediction_error, resolve_precision
from yolokit.accel.batch_size import MemoryModel, find_batch_size, fit_memory_model, is_oom_error, predict_batch_size
from yolokit.accel.checkpointing import (
    checkpointed_modules,
    disable_activation_checkpointing,
    enable_activation_checkpointing,
)
from yolokit.accel.launch import LaunchError, launch
from yolokit.accel.monitor import DeviceMonitor, DeviceStats, read_device_stats
from yolokit.accel.perf import configure, describe, prepare_model
from yolokit.accel.reduce import BatchNormSync, all_reduce_gradients
from yolokit.accel.split import split_batch
from yolokit.accel.stop import GracefulStop, Interrupted

__all__ = [
    "Accumulator",
    "BatchNormSync",
    "DeviceMonitor",
    "DeviceStats",
    "GracefulStop",
    "Interrupted",
    "LaunchError",
    "MemoryModel",
    "Precision",
    "TrainingDiverged",
    "all_reduce_gradients",
    "check_precision",
    "checkpointed_modules",
    "configure",
    "describe",
    "disable_activation_checkpointing",
    "distributed",
    "enable_activation_checkpointing",
    "find_batch_size",
    "fit_memory_model",
    "is_oom_error",
    "launch",
    "predict_batch_size",
    "prediction_error",
    "prepare_model",
    "read_device_stats",
    "resolve_precision",
    "split_batch",
]
