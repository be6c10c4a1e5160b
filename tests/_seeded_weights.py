"""Deterministic weights for comparing two implementations of one architecture: drawn by position.

Both models must list their tensors in the same order with the same shapes (yolokit's model YAML
builds and Ultralytics' DetectionModel do); names only decide the kind of tensor (a batch-norm
statistic, the fixed DFL projection), by suffixes both namings share.
"""

from __future__ import annotations

import math

import torch


def seeded_state(state: dict, seed: int) -> dict:
    """A state dict of the same names and shapes, with values drawn from ``seed`` in order.

    Convolution weights ~ N(0, 1 / fan_in) (activations stay moderate through deep models), batch-norm
    scales 1 + N(0, 0.1^2), shifts and means N(0, 0.1^2), variances U(0.5, 1.5); integers and the DFL
    projection are kept.
    """
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        if not t.is_floating_point() or name.endswith("dfl.conv.weight"):
            out[name] = t.clone()
            continue
        noise = torch.randn(t.shape, generator=g, dtype=torch.float64)
        if name.endswith("running_var"):
            value = 0.5 + torch.rand(t.shape, generator=g, dtype=torch.float64)
        elif t.ndim == 4:
            value = noise / math.sqrt(t[0].numel())
        elif name.endswith("bn.weight"):
            value = 1 + 0.1 * noise
        else:
            value = 0.1 * noise
        out[name] = value.to(t.dtype)
    return out


def seeded_input(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Images in [0, 1] drawn from ``seed``."""
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed))
