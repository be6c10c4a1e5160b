"""Exponential moving average of model weights, with the YOLOv8 warmup of the decay."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from yolokit.train.freeze import under


@dataclass
class _Pairs:
    """The EMA's tensors and the trained model's, paired by state-dict name, made once per model."""

    source: nn.Module
    ema_floats: list[Tensor]
    model_floats: list[Tensor]
    ema_others: list[Tensor]
    model_others: list[Tensor]
    same_dtypes: bool


def _pairs(ema: nn.Module, model: nn.Module, frozen: tuple[str, ...] = ()) -> _Pairs:
    """Pairs every state-dict tensor of ``ema`` with ``model``'s (parameters as Parameter objects,
    so a later ``param.data = ...`` is followed); a tensor shared under two names is updated once;
    tensors under the ``frozen`` prefixes are left out (constant, so averaging would only round)."""
    source = model.state_dict(keep_vars=True)
    pairs = _Pairs(model, [], [], [], [], True)
    seen = set()
    for name, value in ema.state_dict(keep_vars=True).items():
        if id(value) in seen or under(name, frozen):
            continue
        seen.add(id(value))
        new = source[name]
        if value.dtype.is_floating_point:
            pairs.ema_floats.append(value)
            pairs.model_floats.append(new)
            pairs.same_dtypes &= new.dtype == value.dtype
        else:
            pairs.ema_others.append(value)
            pairs.model_others.append(new)
    return pairs


class ModelEMA:
    """Keeps ``ema = d * ema + (1 - d) * model`` for every floating parameter and buffer.

    The decay ramps up as ``d(n) = decay * (1 - exp(-n / tau))`` over the ``n`` updates
    made so far, so early weights do not dominate. Integer buffers (BatchNorm's
    ``num_batches_tracked``) are copied.

    An update is three ``torch._foreach_*`` calls over lists of tensors paired once, on
    the first update with a given model (no state dict is built per step). Moving or
    converting either model afterwards (``.to(device)``, ``.half()``) replaces its buffers:
    make a new ``ModelEMA`` then.

    Args:
        model: the model being trained (an unwrapped module, not DDP).
        decay: asymptotic decay.
        tau: updates over which the decay ramps up.
        updates: updates already made (when resuming).
        frozen: module prefixes the training keeps as they are (``TrainConfig.freeze``): their
            tensors stay the model's, bit for bit (``d * x + (1 - d) * x`` need not round to ``x``).
    """

    def __init__(self, model: nn.Module, decay: float = 0.9999, tau: float = 2000.0, updates: int = 0,
                 frozen: tuple[str, ...] | list[str] = ()):
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        self.decay, self.tau, self.updates, self.frozen = decay, tau, updates, tuple(frozen)
        self._pairs: _Pairs | None = None

    def current_decay(self) -> float:
        return self.decay * (1 - math.exp(-self.updates / self.tau))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """One EMA step towards ``model``'s current weights.

        Bit for bit the per-tensor ``ema.mul_(d).add_(new, alpha=1 - d)``: the foreach ops
        run the same arithmetic (``_foreach_lerp_`` would round differently).
        """
        if self._pairs is None or self._pairs.source is not model:
            self._pairs = _pairs(self.module, model, self.frozen)
        pairs = self._pairs
        self.updates += 1
        d = self.current_decay()
        new = pairs.model_floats
        if not pairs.same_dtypes:
            new = [n.to(e.dtype) for n, e in zip(new, pairs.ema_floats, strict=True)]
        if pairs.ema_floats:
            torch._foreach_mul_(pairs.ema_floats, d)
            torch._foreach_add_(pairs.ema_floats, new, alpha=1 - d)
        if pairs.ema_others:
            torch._foreach_copy_(pairs.ema_others, pairs.model_others)

    def state_dict(self) -> dict:
        return {"module": self.module.state_dict(), "updates": self.updates, "decay": self.decay, "tau": self.tau}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])
        self.updates, self.decay, self.tau = int(state["updates"]), float(state["decay"]), float(state["tau"])
