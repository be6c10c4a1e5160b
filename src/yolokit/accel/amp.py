"""Mixed precision as one narrow object: autocast, scaled backward, guarded step.

The user's loop stays visible::

    precision = Precision("auto", device)
    with precision.autocast():
        loss = criterion(model(images), targets)
    precision.backward(loss)
    stepped = precision.step(optimizer, clip_grad_norm=10.0)
    optimizer.zero_grad(set_to_none=True)

``fp16`` uses :class:`torch.amp.GradScaler`; ``bf16`` and ``fp32`` have no scaler.
:meth:`Precision.step` skips the optimizer step whenever a gradient is inf/NaN, in every
mode, and a watchdog warns when that keeps happening and raises
:class:`TrainingDiverged` after ``max_nonfinite_steps`` skips in a row.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from yolokit.accel.devices import resolve_device

PRECISIONS = ("fp32", "fp16", "bf16", "auto")
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class TrainingDiverged(RuntimeError):
    """Training produced inf/NaN for too long: optimizer steps skipped for inf/NaN gradients
    (:meth:`Precision.check`), or a non-finite loss (the trainer's ``max_bad_steps``)."""


def resolve_precision(precision: str, device: torch.device | str | None = None) -> str:
    """Turn a requested precision into the concrete one used on ``device``.

    ``"auto"`` picks ``bf16`` on a CUDA device that supports it, ``fp16`` on other CUDA
    devices, and ``fp32`` elsewhere (CPU bf16 autocast works but is opt-in: it is slow
    on CPUs without native bf16 units).

    Args:
        precision: One of ``"fp32"``, ``"fp16"``, ``"bf16"``, ``"auto"``.
        device: Target device; ``None`` means CUDA when available, else CPU.

    Returns:
        ``"fp32"``, ``"fp16"`` or ``"bf16"``.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    dev = _device(device)
    if precision == "auto":
        if dev.type != "cuda":
            return "fp32"
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if precision == "bf16" and dev.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError("bf16 was requested but this CUDA device does not support it; use fp16")
    return precision


def _device(device: torch.device | str | None) -> torch.device:
    return device if isinstance(device, torch.device) else resolve_device(device)


class Precision:
    """Autocast context, loss scaling and a guarded optimizer step.

    Args:
        precision: ``"fp32"``, ``"fp16"``, ``"bf16"`` or ``"auto"`` (see
            :func:`resolve_precision`).
        device: Device the model runs on; ``None`` means CUDA when available.
        init_scale: Initial loss scale for fp16.
        growth_interval: Finite steps between scale doublings for fp16.
        warn_after: Consecutive skipped steps after which a warning is issued.
        max_nonfinite_steps: Consecutive skipped steps after which
            :class:`TrainingDiverged` is raised (``0`` disables the error).

    Example:
        >>> precision = Precision("bf16", "cpu")
        >>> precision.dtype, precision.scale
        (torch.bfloat16, 1.0)
    """

    def __init__(
        self,
        precision: str = "auto",
        device: torch.device | str | None = None,
        *,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
        warn_after: int = 8,
        max_nonfinite_steps: int = 25,
    ) -> None:
        self.device = _device(device)
        self.precision = resolve_precision(precision, self.device)
        self.dtype: torch.dtype = _DTYPES[self.precision]
        self.scaler: torch.amp.GradScaler | None = None
        if self.precision == "fp16":
            self.scaler = torch.amp.GradScaler(self.device.type, init_scale=init_scale, growth_interval=growth_interval)
        self.warn_after = warn_after
        self.max_nonfinite_steps = max_nonfinite_steps
        self.nonfinite_steps = 0  # consecutive skipped steps
        self._warned_low_scale = False
        self._unscaled: set[int] = set()  # optimizers unscaled since the last scaler update
        self._runs: torch.Tensor | None = None  # skipped steps on the device: current run, longest since check
        self._warned_run = False

    def __repr__(self) -> str:
        return f"Precision({self.precision!r}, device={str(self.device)!r})"

    @property
    def scale(self) -> float:
        """Current loss scale (``1.0`` when no scaler is in use)."""
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0

    def autocast(self) -> contextlib.AbstractContextManager:
        """Context under which the forward pass and loss run.

        For ``fp32`` this disables autocast explicitly, so an outer autocast does not leak in.
        """
        if self.precision == "fp32":
            return torch.autocast(self.device.type, enabled=False)
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backpropagate ``loss`` (Tensor[] scalar), multiplied by the loss scale for fp16.

        Args:
            loss: Scalar loss.
            **kwargs: Passed to :meth:`torch.Tensor.backward` (e.g. ``retain_graph``).
        """
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward(**kwargs)

    def step(self, optimizer: torch.optim.Optimizer, clip_grad_norm: float | None = None, *,
             blocking: bool = True) -> bool | torch.Tensor:
        """Unscale, optionally clip, and step ``optimizer`` unless a gradient is inf/NaN.

        Gradients are unscaled before clipping, so ``clip_grad_norm`` is in true units. The
        loss scale is updated afterwards (halved after a skipped step). Gradients are not
        zeroed: call ``optimizer.zero_grad()`` yourself. A call that raised inside
        ``optimizer.step`` (out of memory) may be repeated: gradients are not unscaled twice.

        Args:
            optimizer: Optimizer whose parameters hold the accumulated gradients.
            clip_grad_norm: Maximum total L2 norm of the gradients, or ``None``.

            blocking: ``False``: nothing is read back from the device. The step is skipped on
                the device (fused optimizers and the fp16 scaler; other optimizers still read
                the norm), the watchdog counts there, and :meth:`check` reads it when you call it.

        Returns:
            True when the optimizer stepped, False when the step was skipped (with
            ``blocking=False``: the same as a 0-dim bool tensor on the device).
        """
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if self.scaler is not None:
            if id(optimizer) not in self._unscaled:  # a retried step (after OOM) is unscaled already
                self.scaler.unscale_(optimizer)
                self._unscaled.add(id(optimizer))
            norm = _total_norm(params, clip_grad_norm)
            self.scaler.step(optimizer)  # skips when unscale_ found inf/NaN (on the device for fused optimizers)
            self.scaler.update()
            self._unscaled.clear()
        else:
            norm = _total_norm(params, clip_grad_norm)
            if getattr(optimizer, "_step_supports_amp_scaling", False):   # fused: skips on the device
                optimizer.grad_scale, optimizer.found_inf = None, (~torch.isfinite(norm)).float()
                try:
                    optimizer.step()
                finally:
                    del optimizer.grad_scale, optimizer.found_inf
            elif bool(torch.isfinite(norm)):   # other optimizers: the host decides
                optimizer.step()
        stepped = torch.isfinite(norm)
        self._count(stepped)
        if not blocking:
            return stepped
        self.check()
        return bool(stepped)

    def _count(self, stepped: torch.Tensor) -> None:
        """Runs of skipped steps, counted on the device."""
        if self._runs is None or self._runs.device != stepped.device:
            self._runs = torch.zeros(2, dtype=torch.long, device=stepped.device)  # current run, longest since check
        run = (self._runs[0] + 1) * (~stepped)
        self._runs = torch.stack([run, torch.maximum(self._runs[1], run)])

    def check(self) -> None:
        """Read the skipped-step counters (one device read): warn, or raise :class:`TrainingDiverged`.

        ``step()`` calls it after every step; with ``step(blocking=False)`` call it yourself
        every few steps.
        """
        if self._runs is None:
            return
        run, longest = (int(v) for v in self._runs.tolist())
        self._runs[1] = run
        self.nonfinite_steps = run
        if longest >= self.warn_after and not self._warned_run:
            self._warned_run = True
            warnings.warn(
                f"{longest} optimizer steps in a row were skipped for inf/NaN "
                f"gradients (precision={self.precision}, loss scale={self.scale:g}); "
                "check the learning rate, the loss and the data",
                RuntimeWarning,
                stacklevel=3,
            )
        if run == 0:
            self._warned_run = False
        if self.scaler is not None and not self._warned_low_scale and self.scale < 1.0:
            self._warned_low_scale = True
            warnings.warn(
                f"fp16 loss scale fell to {self.scale:g}: gradients overflow fp16 even unscaled; consider bf16 or fp32",
                RuntimeWarning,
                stacklevel=3,
            )
        if self.max_nonfinite_steps and longest >= self.max_nonfinite_steps:
            raise TrainingDiverged(
                f"{longest} consecutive optimizer steps had inf/NaN gradients "
                f"(precision={self.precision}, loss scale={self.scale:g}); training has diverged"
            )

    def state_dict(self) -> dict[str, Any]:
        """State to save in a checkpoint: precision name, scaler state, watchdog counter."""
        if self._runs is not None:
            self.nonfinite_steps = int(self._runs[0])
        return {
            "precision": self.precision,
            "scaler": self.scaler.state_dict() if self.scaler is not None else {},
            "nonfinite_steps": self.nonfinite_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; a scaler state is loaded only when both use one."""
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.nonfinite_steps = int(state.get("nonfinite_steps", 0))
        if self.nonfinite_steps:
            self._runs = torch.tensor([self.nonfinite_steps] * 2, device=self.device)


def _tensors(out: Any) -> Iterator[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, dict):
        for v in out.values():
            yield from _tensors(v)
    elif isinstance(out, (list, tuple)):
        for v in out:
            yield from _tensors(v)


@torch.no_grad()
def prediction_error(
    model: nn.Module,
    precision: str | Precision,
    *,
    imgsz: int | tuple[int, int] = 64,
    batch: int = 2,
    channels: int = 3,
    inputs: torch.Tensor | None = None,
    forward: Callable[[nn.Module, torch.Tensor], Any] | None = None,
    seed: int = 0,
) -> float:
    """Relative error of the model's outputs under ``precision`` against fp32.

    The model runs in eval mode on a generated input (uniform in [0, 1], seeded) and
    its train/eval flags are restored afterwards.

    Args:
        model: Module to test, already on its device.
        precision: A precision name or a :class:`Precision`.
        imgsz: Input size ``S`` or ``(H, W)`` of the generated Tensor[B, channels, H, W].
        batch: Batch size ``B`` of the generated input.
        channels: Channels of the generated input.
        inputs: Use this input instead of generating one.
        forward: ``forward(model, x)`` returning a tensor or nested list/dict of tensors;
            defaults to ``model(x)``.
        seed: Seed for the generated input.

    Returns:
        The largest ``||y_lp - y_fp32|| / ||y_fp32||`` over output tensors; ``inf`` when
        the low-precision output holds inf/NaN.
    """
    device = next(model.parameters()).device
    prec = precision if isinstance(precision, Precision) else Precision(precision, device)
    if inputs is None:
        h, w = (imgsz, imgsz) if isinstance(imgsz, int) else imgsz
        gen = torch.Generator().manual_seed(seed)
        inputs = torch.rand(batch, channels, h, w, generator=gen)
    inputs = inputs.to(device)
    run = forward or (lambda m, x: m(x))
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.autocast(device.type, enabled=False):
            ref = [t.float() for t in _tensors(run(model, inputs))]
        with prec.autocast():
            low = [t.float() for t in _tensors(run(model, inputs))]
    finally:
        for m, mode in modes:
            m.training = mode
    err = 0.0
    for a, b in zip(low, ref, strict=True):
        if not torch.isfinite(a).all():
            return float("inf")
        err = max(err, float((a - b).norm() / b.norm().clamp_min(1e-12)))
    return err


def check_precision(
    model: nn.Module,
    precision: str = "auto",
    *,
    imgsz: int | tuple[int, int] = 64,
    batch: int = 2,
    tol: float = 0.05,
    inputs: torch.Tensor | None = None,
    forward: Callable[[nn.Module, torch.Tensor], Any] | None = None,
    seed: int = 0,
    **precision_kwargs: Any,
) -> Precision:
    """Build a :class:`Precision` for ``model`` and fall back to fp32 if it misbehaves.

    Compares the model's outputs under the resolved precision with fp32 on a generated
    input (see :func:`prediction_error`); nothing is downloaded.

    Args:
        model: Module to check, already on its device.
        precision: Requested precision (``"auto"`` resolves per device).
        imgsz: Generated input size.
        batch: Generated input batch size.
        tol: Largest acceptable relative output error.
        inputs: Use this input instead of a generated one.
        forward: ``forward(model, x)``; defaults to ``model(x)``.
        seed: Seed for the generated input.
        **precision_kwargs: Passed to :class:`Precision`.

    Returns:
        The requested Precision, or an fp32 one (with a RuntimeWarning) when the error
        exceeds ``tol``.
    """
    device = next(model.parameters()).device
    prec = Precision(precision, device, **precision_kwargs)
    if prec.precision == "fp32":
        return prec
    err = prediction_error(model, prec, imgsz=imgsz, batch=batch, inputs=inputs, forward=forward, seed=seed)
    if err <= tol:
        return prec
    warnings.warn(
        f"{prec.precision} outputs differ from fp32 by {err:.3g} (tolerance {tol:g}); falling back to fp32",
        RuntimeWarning,
        stacklevel=2,
    )
    return Precision("fp32", device, **precision_kwargs)


def _total_norm(params: list[torch.Tensor], clip: float | None) -> torch.Tensor:
    """Total L2 norm of the gradients (a 0-dim tensor on their device), clipped to ``clip`` if given."""
    if not params:
        return torch.zeros(())
    if clip is not None:
        return nn.utils.clip_grad_norm_(params, clip)
    return nn.utils.get_total_norm([p.grad for p in params])

