"""Optimizer with parameter groups, and the warmup + linear/cosine learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from yolokit.accel.musgd import MuSGD, musgd_param_groups

OPTIMIZERS = ("sgd", "adamw", "musgd")  # what resolve_optimizer returns (lower case)


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Three groups: conv/linear weights (decayed), norm weights and biases (no decay).

    The group order is fixed (weights, norm weights, biases) so that warmup can give
    biases their own learning rate: group 2 is always the biases.
    """
    decay, norm, bias = [], [], []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            if name == "bias":
                bias.append(p)
            elif isinstance(module, (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)):
                norm.append(p)
            else:
                decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay, "name": "weights"},
        {"params": norm, "weight_decay": 0.0, "name": "norm"},
        {"params": bias, "weight_decay": 0.0, "name": "bias"},
    ]


def resolve_bias_lr(given: float | None) -> float:
    """The biases' learning rate at the warmup's start: ``given`` when set, else ``LRSchedule``'s 0.1 for every
    model. The reference's automatic optimizer starts them at 0; on the demo that costs YOLOv8n 0.092 and
    YOLO26n 0.066 of mean mAP50-95 over five seeds (BENCHMARKS.md)."""
    return LRSchedule.warmup_bias_lr if given is None else float(given)


def resolve_optimizer(name: str, lr0: float, momentum: float, *, num_classes: int,
                      iterations: int, end_to_end: bool = False) -> tuple[str, float, float]:
    """(name, lr, momentum) after resolving "auto"; names are case-insensitive (SGD, AdamW, MuSGD, auto).

    "auto": more than 10,000 iterations -> SGD at 0.01 with momentum 0.9 (YOLOv8's rule), or
    MuSGD at 0.01 and 0.9 for an end-to-end (YOLO26) model, ``end_to_end`` being
    ``model.head.end_to_end``; otherwise AdamW at ``round(0.002 * 5 / (4 + num_classes), 6)``
    with beta1 0.9. Ultralytics 8.4 picks MuSGD for long runs of every model; here YOLOv8-style
    models keep SGD, as their runs always have.
    """
    key = name.lower()
    if key == "auto":
        if iterations > 10_000:
            return ("musgd" if end_to_end else "sgd"), 0.01, 0.9
        return "adamw", round(0.002 * 5 / (4 + num_classes), 6), 0.9
    if key not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; expected SGD, AdamW, MuSGD or auto")
    return key, lr0, momentum


_FUSED_DEVICES = ("cpu", "cuda")  # where torch's fused SGD / AdamW kernels exist (torch >= 2.4)


def build_optimizer(model: nn.Module, name: str, lr: float, momentum: float,
                    weight_decay: float, *, fused: bool | None = None) -> torch.optim.Optimizer:
    """SGD (Nesterov) or AdamW over ``parameter_groups``, or MuSGD; ``name`` already resolved.

    MuSGD (:class:`yolokit.accel.MuSGD`, YOLO26's optimizer) takes its own groups
    (:func:`yolokit.accel.musgd_param_groups`: Muon on conv and linear weights at 0.2 lr plus
    SGD at 1.0 lr, SGD on the rest, the class branches at 3x lr, all Nesterov) and steps with
    foreach kernels; ``fused`` does not apply to it.

    The SGD and AdamW step is one fused kernel per parameter group and dtype rather than a
    Python loop over the parameters: ``fused`` where the parameters' device has fused
    kernels, else the ``foreach`` implementation. On the CPU the fused SGD step equals the per-parameter
    one bit for bit; fused AdamW rounds differently (about 1e-8 apart after a step). Both
    work with ``torch.amp.GradScaler``, including after ``unscale_``.

    Args:
        fused: True / False to choose; None picks fused on the CPU and CUDA.
    """
    if name == "musgd":
        return MuSGD(musgd_param_groups(model, lr, momentum, weight_decay), lr=lr, momentum=momentum)
    groups = parameter_groups(model, weight_decay)
    if fused is None:
        devices = {p.device.type for g in groups for p in g["params"]}
        fused = bool(devices) and devices <= set(_FUSED_DEVICES)
    impl = {"fused": True} if fused else {"foreach": True}
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=True, **impl)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=(momentum, 0.999), **impl)
    raise ValueError(f"unknown optimizer {name!r}")


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """``optimizer.load_state_dict(state)`` keeping ``optimizer``'s implementation (fused / foreach).

    A plain load takes those flags from the saved groups too, so a checkpoint written by
    another implementation (or before it was chosen) would silently switch it; applying
    the current flags before the load also places AdamW's step counters where the fused
    kernels want them.
    """
    groups = [{**saved, **{k: current[k] for k in ("fused", "foreach") if k in current}}
              for saved, current in zip(state["param_groups"], optimizer.param_groups, strict=True)]
    optimizer.load_state_dict({**state, "param_groups": groups})


@dataclass
class LRSchedule:
    """Per-iteration learning rate and momentum: a warmup ramp, then linear or cosine decay per epoch.

    Attributes:
        lr0: peak learning rate.
        lrf: final learning rate as a fraction of lr0.
        epochs: total epochs.
        iters_per_epoch: optimizer-independent iterations (batches) per epoch.
        warmup_epochs: length of the warmup, at least ``warmup_min_iters`` iterations when non-zero.
        warmup_momentum: momentum at the start of warmup.
        warmup_bias_lr: bias learning rate at the start of warmup (it falls to the schedule).
        momentum: momentum after warmup.
        cosine: cosine instead of linear decay.
        warmup_min_iters: the warmup's floor in iterations (100, as the reference's trainer had it up to 8.3;
            0: ``warmup_epochs`` alone, as its 8.4 has it).
    """

    lr0: float
    lrf: float
    epochs: int
    iters_per_epoch: int
    warmup_epochs: float = 3.0
    warmup_momentum: float = 0.8
    warmup_bias_lr: float = 0.1
    momentum: float = 0.937
    cosine: bool = False
    warmup_min_iters: int = 100

    @property
    def warmup_iters(self) -> int:
        if self.warmup_epochs <= 0:
            return 0
        return max(round(self.warmup_epochs * self.iters_per_epoch), self.warmup_min_iters)

    def factor(self, epoch: int) -> float:
        """Decay factor of the learning rate at ``epoch`` (1 at epoch 0, lrf at the end)."""
        x = epoch / self.epochs
        if self.cosine:
            return ((1 - math.cos(x * math.pi)) / 2) * (self.lrf - 1) + 1
        return (1 - x) * (1.0 - self.lrf) + self.lrf

    def apply(self, optimizer: torch.optim.Optimizer, epoch: int, iteration: int) -> None:
        """Sets every group's lr (and momentum during warmup) for global ``iteration`` in ``epoch``.

        A group's ``lr_scale`` (MuSGD's class branches: 3) multiplies its target lr.
        """
        factor, warm = self.factor(epoch), self.warmup_iters
        for group in optimizer.param_groups:
            target = self.lr0 * group.get("lr_scale", 1.0) * factor
            if iteration < warm:
                t = iteration / warm
                start = self.warmup_bias_lr if group.get("name") == "bias" else 0.0
                group["lr"] = start + (target - start) * t
                m = self.warmup_momentum + (self.momentum - self.warmup_momentum) * t
                if "momentum" in group:
                    group["momentum"] = m
                elif "betas" in group:
                    group["betas"] = (m, group["betas"][1])
            else:
                group["lr"] = target
