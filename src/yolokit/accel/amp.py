"""Mixed precision as one narrow object: autocast, scaled backward, guarded step.

The user's loop stays visible::

    precision = Precision("auto", device)
    with precision.autocast():
        loss = criterion(model(images), targets)
    precision.backward(loss)
    precision.unscale_(optimizer)                        # fp16: gradients in true units
    norm = precision.clip_grad_norm_(optimizer, 10.0)    # their total norm, clipped to 10
    precision.step(optimizer, norm)                      # skipped when the norm is inf/NaN
    optimizer.zero_grad(set_to_none=True)

(``precision.step(optimizer, clip_grad_norm=10.0)`` does the three in one call.) ``fp16``
uses :class:`torch.amp.GradScaler`; ``bf16`` and ``fp32`` have no scaler. A step is skipped
whenever a gradient is inf/NaN, in every mode; the skips are counted on the device, and
:meth:`Precision.check` reads the count (warning when it keeps happening). Deciding that
training diverged is the watchdog's job (:mod:`yolokit.accel.divergence`).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from yolokit.accel.devices import resolve_device
from yolokit.accel.graphs import capturable

PRECISIONS = ("fp32", "fp16", "bf16", "auto")
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


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
        warn_after: Consecutive skipped steps after which :meth:`check` warns.

    Examples:
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
    ) -> None:
        self.device = _device(device)
        self.precision = resolve_precision(precision, self.device)
        self.dtype: torch.dtype = _DTYPES[self.precision]
        self.scaler: torch.amp.GradScaler | None = None
        if self.precision == "fp16":
            self.scaler = torch.amp.GradScaler(self.device.type, init_scale=init_scale, growth_interval=growth_interval)
        self.warn_after = warn_after
        self.nonfinite_steps = 0  # consecutive skipped steps, as last read
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

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """fp16: divide the gradients by the loss scale (true units for clipping); otherwise nothing.

        Once per step: a step repeated after out of memory does not unscale twice.
        """
        if self.scaler is not None and id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def clip_grad_norm_(self, optimizer: torch.optim.Optimizer, max_norm: float | None) -> torch.Tensor:
        """The total L2 norm of the gradients (a 0-dim tensor on their device, nothing read), after
        clipping them to ``max_norm`` when it is given. Call it after :meth:`unscale_`."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        return _total_norm(params, max_norm or None)

    def step(self, optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor | None = None, *,
             clip_grad_norm: float | None = None, blocking: bool = True) -> bool | torch.Tensor:
        """``optimizer.step()`` unless a gradient is inf/NaN; fp16: then the loss scale is updated.

        Gradients are not zeroed: call ``optimizer.zero_grad()`` yourself. A call that raised
        inside ``optimizer.step`` (out of memory) may be repeated. Called while a CUDA graph records
        (:class:`yolokit.accel.graphs.StepGraphs`), it makes Adam(W)'s groups ``capturable`` for the
        recording, as torch requires.

        Args:
            optimizer: Optimizer whose parameters hold the accumulated gradients.
            grad_norm: Their total norm from :meth:`clip_grad_norm_`. None: :meth:`unscale_` and
                :meth:`clip_grad_norm_` (with ``clip_grad_norm``) run here first.
            clip_grad_norm: With ``grad_norm=None``, the maximum total norm (None: no clipping).
            blocking: ``False``: nothing is read back from the device. The step is skipped on
                the device (fused optimizers, MuSGD and the fp16 scaler; other optimizers still read
                the norm), the skips are counted there, and :meth:`check` reads them when you
                call it. ``True``: :meth:`check` runs after the step.

        Returns:
            True when the optimizer stepped, False when the step was skipped (with
            ``blocking=False``: the same as a 0-dim bool tensor on the device).
        """
        if grad_norm is None:
            self.unscale_(optimizer)
            grad_norm = self.clip_grad_norm_(optimizer, clip_grad_norm)
        _zero_momentum_before_first_step(optimizer)
        if self.scaler is not None:
            with capturable(optimizer):   # skips when unscale_ found inf/NaN (on the device: fused, MuSGD)
                self.scaler.step(optimizer)
            self.scaler.update()
            self._unscaled.clear()
        elif getattr(optimizer, "_step_supports_amp_scaling", False):   # fused, MuSGD: skip on the device
            optimizer.grad_scale, optimizer.found_inf = None, (~torch.isfinite(grad_norm)).float()
            try:
                with capturable(optimizer):   # recorded as a CUDA graph: Adam(W) must say so
                    optimizer.step()
            finally:
                del optimizer.grad_scale, optimizer.found_inf
        elif bool(torch.isfinite(grad_norm)):   # other optimizers: the host decides
            optimizer.step()
        stepped = torch.isfinite(grad_norm)
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
        # in place: a step recorded as a CUDA graph updates this very tensor at each replay
        self._runs.copy_(torch.stack([run, torch.maximum(self._runs[1], run)]))

    def reset_step(self) -> None:
        """Forget a step begun but not finished (a failed graph recording): gradients may be
        unscaled again."""
        self._unscaled.clear()
        if self.scaler is not None:
            getattr(self.scaler, "_per_optimizer_states", {}).clear()   # torch's per-step stage of each optimizer

    def check(self) -> int:
        """Read the skipped-step counters (one device read) and warn when steps keep being skipped.

        Returns:
            The longest run of consecutive steps skipped since the last call that loss scaling
            does not explain (what a divergence watchdog compares with its limit): with fp16
            only while the loss scale is below 1 (until then the scaler is still settling:
            each skip halves it), otherwise every skip.
        """
        if self._runs is None:
            return 0
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
        return longest if self.scaler is None or self.scale < 1.0 else 0

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


def _total_norm(params: list[torch.Tensor], clip: float | None) -> torch.Tensor:
    """Total L2 norm of the gradients (a 0-dim tensor on their device), clipped to ``clip`` if given."""
    if not params:
        return torch.zeros(())
    if clip is not None:
        return nn.utils.clip_grad_norm_(params, clip)
    return nn.utils.get_total_norm([p.grad for p in params])


def _zero_momentum_before_first_step(optimizer: torch.optim.Optimizer) -> None:
    """Fused SGD's momentum buffers as zeros before its first step, where they are missing.

    torch's fused SGD makes them with ``empty_like`` on its first step and, when that step is
    skipped on the device (fp16's first steps overflow; a NaN), keeps them without writing them:
    the next step then reads whatever the memory held. Zeros give the first step's own result bit
    for bit (``momentum * 0 + grad`` is ``grad``) whether or not it is skipped. Only without
    dampening, where that holds.
    """
    if optimizer in _PRIMED or not (isinstance(optimizer, torch.optim.SGD)
                                    and getattr(optimizer, "_step_supports_amp_scaling", False)):
        return
    for group in optimizer.param_groups:
        if group["momentum"] == 0 or group["dampening"] != 0:
            continue
        for p in group["params"]:
            if p.grad is not None and "momentum_buffer" not in optimizer.state[p]:
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    _PRIMED.add(optimizer)   # checked once: the parameters that have gradients now have buffers


_PRIMED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
