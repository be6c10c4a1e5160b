"""Exponential moving average of model weights, with the YOLOv8 warmup of the decay."""

from __future__ import annotations

import copy
import math

import torch
from torch import nn


class ModelEMA:
    """Keeps ``ema = d * ema + (1 - d) * model`` for every floating parameter and buffer.

    The decay ramps up as ``d(n) = decay * (1 - exp(-n / tau))`` over the ``n`` updates
    made so far, so early weights do not dominate. Integer buffers (BatchNorm's
    ``num_batches_tracked``) are copied.

    Args:
        model: the model being trained (an unwrapped module, not DDP).
        decay: asymptotic decay.
        tau: updates over which the decay ramps up.
    """

    def __init__(self, model: nn.Module, decay: float = 0.9999, tau: float = 2000.0, updates: int = 0):
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        self.decay, self.tau, self.updates = decay, tau, updates

    def current_decay(self) -> float:
        return self.decay * (1 - math.exp(-self.updates / self.tau))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """One EMA step towards ``model``'s current weights."""
        self.updates += 1
        d = self.current_decay()
        source = model.state_dict()
        for name, value in self.module.state_dict().items():
            new = source[name].detach()
            if value.dtype.is_floating_point:
                value.mul_(d).add_(new.to(value.dtype), alpha=1 - d)
            else:
                value.copy_(new)

    def state_dict(self) -> dict:
        return {"module": self.module.state_dict(), "updates": self.updates, "decay": self.decay, "tau": self.tau}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])
        self.updates, self.decay, self.tau = int(state["updates"]), float(state["decay"]), float(state["tau"])
