"""The processes of a run, this process's device, and the speed settings that follow from them.

``start_processes`` joins the process group when torchrun (or ``train(config)`` with
``devices`` > 1) started several processes, and returns the device this one trains on.
``speed_settings`` resolves the switches a config leaves unset for that device: on CUDA the
fast ones (cuDNN benchmark, non-deterministic kernels, TF32, a loader worker for every core
but the training process's, pinned memory), on the CPU the exact ones (deterministic
kernels, so that resume is exact).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

from yolokit.accel import distributed
from yolokit.train.config import TrainConfig


def start_processes(cfg: TrainConfig) -> torch.device:
    """This process's device; joins the process group when torchrun (or ``train``) started several."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world == 1:
        if cfg.devices > 1:
            raise ValueError(f"devices={cfg.devices}: start the processes with yolokit.train.train(config) "
                             "(or `yolokit train --devices N`), or run under torchrun")
        return _pick_device(cfg.device)
    if cfg.devices not in (1, world):
        raise ValueError(f"devices={cfg.devices} but torchrun started {world} processes; leave devices unset "
                         "under torchrun")
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0 and cfg.resume != "auto":
        warnings.warn("torchrun --max-restarts restarts the group, which continues this run only with "
                      "resume='auto' (--resume auto); as it is, a restart starts a new run", stacklevel=2)
    device_type = None if cfg.device == "auto" else torch.device(cfg.device).type
    return distributed.setup(device_type=device_type)


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available")
    return device


@dataclass(frozen=True)
class SpeedSettings:
    """The switches a run trains with (see :func:`speed_settings`)."""

    deterministic: bool
    cudnn_benchmark: bool
    tf32: bool
    workers: int
    pin_memory: bool

    def apply(self) -> str:
        """Sets the global switches (``accel.perf.configure``); returns its one-line description."""
        from yolokit.accel import perf

        return perf.configure(cudnn_benchmark=self.cudnn_benchmark, tf32=self.tf32, deterministic=self.deterministic)


def cores_per_process(world_on_this_machine: int = 1) -> int:
    """CPU cores this process may use: its affinity (a scheduler's share) split among the machine's processes."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, world_on_this_machine))


def speed_settings(cfg: TrainConfig, device: torch.device, local_world: int = 1) -> SpeedSettings:
    """``cfg``'s speed switches for ``device``, its unset ones (None) resolved.

    CUDA: non-deterministic kernels with cuDNN's benchmark (it picks the fastest convolution
    per shape), TF32 in float32 matmuls and convolutions, ``cores per process - 1`` loader
    workers (the training process keeps a core), pinned host memory. CPU: deterministic
    kernels (an interrupted run resumes to the same bits), 2 workers, no pinning.
    ``deterministic=True`` on CUDA turns the benchmark off.
    """
    cuda = device.type == "cuda"
    deterministic = cfg.deterministic if cfg.deterministic is not None else not cuda
    workers = cfg.workers if cfg.workers is not None else (
        max(1, cores_per_process(local_world) - 1) if cuda else 2)
    return SpeedSettings(deterministic=deterministic, cudnn_benchmark=cuda and not deterministic,
                         tf32=cfg.tf32 if cfg.tf32 is not None else cuda, workers=workers, pin_memory=cuda)
