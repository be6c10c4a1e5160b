"""The processes of a run and this process's device.

``start_processes`` joins the process group when torchrun (or ``train(config)`` with
``devices`` > 1) started several processes, and returns the device this one trains on.
"""

from __future__ import annotations

import os
import warnings

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
