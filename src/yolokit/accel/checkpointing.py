"""Activation checkpointing for chosen submodules, in place, with state_dict keys unchanged.

A checkpointed unit keeps only its inputs during the forward pass and recomputes its
activations during backward (``torch.utils.checkpoint`` in non-reentrant mode), trading
compute for activation memory. Outputs and gradients are unchanged.

How it is wired: :func:`enable_activation_checkpointing` sets an instance attribute
``forward`` on each chosen module: a small callable that holds the module (so
``copy.deepcopy`` and pickling of the model follow the copy) and routes the class's own
forward through ``checkpoint``. No wrapper module is inserted, so parameter and buffer
names, and therefore checkpoints, are unaffected. :func:`disable_activation_checkpointing`
deletes the attribute again.

Buffers written during forward (BatchNorm running statistics and
``num_batches_tracked`` in train mode) would otherwise be updated twice per step, once
in the forward and again in the recompute. The recompute runs under a context that
snapshots the unit's buffers when recomputation starts and copies them back when it
ends, so running statistics match an unwrapped run exactly.

Under ``torch.compile`` the unit calls plain ``checkpoint`` instead (dynamo cannot trace
a ``context_fn`` closure): AOTAutograd turns the buffer writes into outputs of the
forward graph that are copied back once, and the backward's recompute replays pure ops,
so running statistics are again written once per forward. The model's forward stays
one graph.

Examples:
    >>> model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.SiLU())
    >>> enable_activation_checkpointing([model], every=1)
    ['0']
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


@contextlib.contextmanager
def _buffers_restored(module: nn.Module) -> Iterator[None]:
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, value in saved:
                buf.copy_(value)


class _CheckpointedForward:
    """Callable stored as ``module.forward``; holds the module, so deepcopy and pickle follow it."""

    def __init__(self, module: nn.Module, inner: Any = None) -> None:
        self.module = module
        self.inner = inner  # a forward someone else had set on the instance, if any

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self._run(*args, **kwargs)
        fn = functools.partial(self._run, **kwargs) if kwargs else self._run
        if torch.compiler.is_compiling():
            # AOTAutograd functionalizes the buffer writes: they run once, after the forward,
            # and the recompute in backward replays pure ops only. No context is needed, and
            # dynamo cannot trace one (it accepts no closure as context_fn).
            return checkpoint(fn, *args, use_reentrant=False)
        module = self.module

        def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
            return contextlib.nullcontext(), _buffers_restored(module)

        return checkpoint(fn, *args, use_reentrant=False, context_fn=contexts)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`enable_activation_checkpointing` has wrapped ``module``."""
    return isinstance(module.__dict__.get("forward"), _CheckpointedForward)


def _named(modules: Iterable[nn.Module | tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    named = []
    for i, item in enumerate(modules):
        name, module = item if isinstance(item, tuple) else (str(i), item)
        if not isinstance(module, nn.Module):
            raise TypeError(f"expected nn.Module or (name, nn.Module), got {type(module).__name__}")
        named.append((name, module))
    return named


def enable_activation_checkpointing(modules: Iterable[nn.Module | tuple[str, nn.Module]], every: int = 1) -> list[str]:
    """Route the forward of every ``every``-th module through activation checkpointing.

    Args:
        modules: Modules, or ``(name, module)`` pairs such as
            ``Detector.checkpoint_units("backbone")``. Unnamed modules are named by
            their position.
        every: Wrap modules ``0, every, 2*every, ...`` of the sequence; ``1`` wraps all.

    Returns:
        Names of the modules now checkpointed (already wrapped ones included).
    """
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    wrapped = []
    for i, (name, module) in enumerate(_named(modules)):
        if i % every:
            continue
        if not is_checkpointed(module):
            module.forward = _CheckpointedForward(module, module.__dict__.get("forward"))
        wrapped.append(name)
    return wrapped


def disable_activation_checkpointing(modules: Iterable[nn.Module | tuple[str, nn.Module]]) -> list[str]:
    """Undo :func:`enable_activation_checkpointing` on ``modules`` (and their submodules).

    Args:
        modules: Modules or ``(name, module)`` pairs; a whole model may be passed.

    Returns:
        Qualified names (``name`` or ``name.sub``) of the modules that were unwrapped.
    """
    unwrapped = []
    for name, root in _named(modules):
        for sub_name, module in root.named_modules():
            if not is_checkpointed(module):
                continue
            inner = module.__dict__.pop("forward").inner
            if inner is not None:
                module.forward = inner
            unwrapped.append(f"{name}.{sub_name}" if sub_name else name)
    return unwrapped


def checkpointed_modules(model: nn.Module) -> list[str]:
    """Qualified names of the submodules of ``model`` that are checkpointed."""
    return [name for name, m in model.named_modules() if is_checkpointed(m)]
