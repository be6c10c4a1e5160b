"""Speed switches: cudnn.benchmark, TF32, determinism, channels_last, torch.compile, and what is on.

Global switches go through :func:`configure`; per-model ones through
:func:`prepare_model`. Both leave a switch alone when given ``None``. :func:`describe`
reads the actual state back as one line for the log::

    print(configure(cudnn_benchmark=True, tf32=True, deterministic=False))
    model = prepare_model(model, channels_last=True, compile=False)
    print(describe(model))
    # cudnn.benchmark=on tf32(matmul)=on tf32(conv)=on deterministic=off channels_last=on compile=off

TF32 is set through the ``allow_tf32`` flags: PyTorch then keeps its newer
``fp32_precision`` settings in step, and both stay readable (setting ``fp32_precision``
alone makes ``allow_tf32`` and ``get_float32_matmul_precision`` raise, and inductor's
max-autotune reads them).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn


def _onoff(flag: bool | None) -> str:
    return "n/a" if flag is None else ("on" if flag else "off")


def _tf32_state() -> tuple[bool | None, bool | None]:
    """(matmul, conv) TF32 flags, read through the ``allow_tf32`` flags; where someone set only the
    newer ``fp32_precision`` settings (which makes the older flags unreadable), through those."""
    try:
        return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    except (AttributeError, RuntimeError):
        pass

    def read(getter):
        try:
            return getter()
        except (AttributeError, RuntimeError):
            return None

    top = read(lambda: torch.backends.fp32_precision)
    matmul = read(lambda: torch.backends.cuda.matmul.fp32_precision)
    conv = read(lambda: torch.backends.cudnn.conv.fp32_precision)
    if conv == "none":
        conv = read(lambda: torch.backends.cudnn.fp32_precision)
    if matmul is None or conv is None:
        return None, None
    matmul = top if matmul == "none" else matmul
    conv = top if conv == "none" else conv
    # "none" all the way up means PyTorch's defaults: IEEE matmuls, TF32 cuDNN convolutions
    return matmul == "tf32", conv != "ieee"


def configure(*, cudnn_benchmark: bool | None = None, tf32: bool | None = None,
              deterministic: bool | None = None) -> str:
    """Set the global speed switches; ``None`` leaves a switch as it is.

    Args:
        cudnn_benchmark: Let cuDNN time convolution algorithms per input shape (fast for
            fixed image sizes, re-tunes on every new shape).
        tf32: Allow TensorFloat-32 in float32 matmuls and convolutions on Ampere+ GPUs.
        deterministic: True: deterministic kernels (``torch.use_deterministic_algorithms``
            in warn-only mode: an op without a deterministic kernel warns instead of
            stopping the run), deterministic cuDNN without benchmarking (unless
            ``cudnn_benchmark`` says otherwise), and ``CUBLAS_WORKSPACE_CONFIG`` set if
            unset (it must be set before the first cuBLAS call). PyTorch's filling of every
            ``torch.empty`` with NaN in that mode (``fill_uninitialized_memory``) is turned
            off: an extra write per allocation, and every kernel here overwrites what it
            allocates. False: PyTorch's defaults back.

    Returns:
        One line describing what is on (see :func:`describe`).
    """
    if deterministic is not None:
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = not deterministic
        torch.backends.cudnn.deterministic = deterministic
        if deterministic:
            torch.backends.cudnn.benchmark = False
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if cudnn_benchmark is not None:
        torch.backends.cudnn.benchmark = cudnn_benchmark
    if tf32 is not None:   # through allow_tf32: PyTorch keeps fp32_precision in step, and both stay readable
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    return describe()


def is_channels_last(model: nn.Module) -> bool | None:
    """Whether the model's 4-d weights are channels_last (None when it has none)."""
    weights = [p for p in model.parameters() if p.dim() == 4]
    if not weights:
        return None
    return all(p.is_contiguous(memory_format=torch.channels_last) for p in weights)


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` (or something it wraps, e.g. DDP's module) is torch.compile'd."""
    while model is not None:
        if isinstance(getattr(model, "_orig_mod", None), nn.Module):
            return True
        model = getattr(model, "module", None)
    return False


def prepare_model(
    model: nn.Module,
    *,
    channels_last: bool | None = None,
    compile: bool = False,
    compile_mode: str | None = None,
    compile_backend: str | Callable = "inductor",
    compile_dynamic: bool | None = None,
) -> nn.Module:
    """Apply per-model switches.

    Compiling works with activation checkpointing (:mod:`yolokit.accel.checkpointing`),
    channels_last and autocast, and a detector's forward compiles to one graph. Compile
    the training module only: every new input shape costs a compile, so a batch of
    another size (an epoch's last, smaller one) compiles once more, with the batch
    dimension then dynamic (PyTorch's automatic dynamic shapes), and later sizes reuse
    that graph; switching train/eval mode also compiles once per mode. Validation with
    rectangular batches (many shapes) runs the plain module.

    Args:
        model: The model, on its device. Feed it inputs converted with
            ``x.to(memory_format=torch.channels_last)`` when channels_last is on.
        channels_last: Convert 4-d weights to NHWC (faster convolutions under AMP on
            tensor cores) or back to contiguous; ``None`` leaves them.
        compile: Return ``torch.compile(model, mode=compile_mode, backend=compile_backend)``.
        compile_mode: ``None``, ``"default"``, ``"reduce-overhead"``, ``"max-autotune"``
            (inductor only).
        compile_backend: ``"inductor"`` (needs a C++ compiler on the CPU, Triton on GPUs)
            or e.g. ``"aot_eager"`` (same graphs, eager kernels; no compiler needed), or
            a backend callable.
        compile_dynamic: torch.compile's ``dynamic`` (True: sizes symbolic from the first call, as a
            loss whose padded box count changes every batch wants); None: PyTorch's automatic choice.

    Returns:
        The same model (converted in place) or its compiled wrapper; keep the original
        reference (or :func:`yolokit.accel.distributed.unwrap`) for saving weights.
    """
    if channels_last is not None:
        model.to(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    if compile:
        dynamic = {} if compile_dynamic is None else {"dynamic": compile_dynamic}
        model = torch.compile(model, mode=compile_mode, backend=compile_backend, **dynamic)
    return model


def describe(model: nn.Module | None = None) -> str:
    """One line saying which speed switches are on.

    Args:
        model: When given, also report channels_last and compile for it.

    Returns:
        e.g. ``"cudnn.benchmark=on tf32(matmul)=off tf32(conv)=on deterministic=off"``
        (+ model switches); ``deterministic=warn`` when deterministic algorithms are on in
        warn-only mode.
    """
    matmul, conv = _tf32_state()
    deterministic = "off"
    if torch.are_deterministic_algorithms_enabled():
        deterministic = "warn" if torch.is_deterministic_algorithms_warn_only_enabled() else "on"
    parts = [
        f"cudnn.benchmark={_onoff(torch.backends.cudnn.benchmark)}",
        f"tf32(matmul)={_onoff(matmul)}",
        f"tf32(conv)={_onoff(conv)}",
        f"deterministic={deterministic}",
    ]
    if model is not None:
        parts.append(f"channels_last={_onoff(is_channels_last(model))}")
        parts.append(f"compile={_onoff(is_compiled(model))}")
    return " ".join(parts)
