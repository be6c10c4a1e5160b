"""A CPU stand-in for CUDA graphs: the step traced by ``make_fx`` and replayed from the trace.

A replay of ``make_fx``'s graph does what a CUDA graph replay does, and nothing more: the same
aten operations on the same tensors (every tensor the step did not make is a constant of the
trace, the very object), with every Python number frozen at its value while tracing. A step
that is not safe to record therefore gives other numbers when replayed here than when run
eagerly: a learning rate read from Python and changed later, state replaced instead of updated
in place, a tensor made from host data. Unlike a CUDA recording, tracing also runs the step
once (``runs_while_recording``).

``TapeBackend.kept`` lists, after each recording, the tensors the step made while being
recorded that are still reachable from the objects passed as ``watch`` (a model, an optimizer,
a Precision): a CUDA graph would have made them in its pool, where another graph's replay may
overwrite them.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten


def reachable_tensors(objects: Iterable[Any]) -> dict[int, str]:
    """Tensors reachable from models (parameters, their gradients, buffers), optimizers (state) and
    objects' attributes (one level of lists, dicts and tensors), by id, with a name."""
    found: dict[int, str] = {}

    def add(t: Any, name: str) -> None:
        if isinstance(t, Tensor):
            found.setdefault(id(t), name)

    for i, obj in enumerate(objects):
        if isinstance(obj, torch.nn.Module):
            for n, p in obj.named_parameters():
                add(p, n)
                add(p.grad, n + ".grad")
            for n, b in obj.named_buffers():
                add(b, n)
        elif isinstance(obj, torch.optim.Optimizer):
            for k, (p, state) in enumerate(obj.state.items()):
                for key, value in state.items():
                    add(value, f"optimizer.state[{k}].{key}")
                add(p.grad, f"optimizer.param[{k}].grad")
        else:
            for attr, value in vars(obj).items():
                for j, leaf in enumerate(tree_flatten(value)[0]):
                    add(leaf, f"{type(obj).__name__}.{attr}[{j}]")
            for attr in ("scaler",):
                scaler = getattr(obj, attr, None)
                if scaler is not None:
                    for a, value in vars(scaler).items():
                        add(value, f"{type(obj).__name__}.scaler.{a}")
        _ = i
    return found


class _WithoutStacks:
    """``traceback`` as fake_tensor.py sees it, but ``extract_stack`` returns an empty stack."""

    @staticmethod
    def extract_stack(*args: Any, **kwargs: Any) -> traceback.StackSummary:
        return traceback.StackSummary()

    def __getattr__(self, name: str) -> Any:
        return getattr(traceback, name)


@contextlib.contextmanager
def _no_mode_stacks():
    """make_fx in its real mode makes a FakeTensorMode for each value it traces, and each mode keeps the
    Python stack it was made in (for debugging messages): half of a step's tracing time under pytest's
    deep stacks. The trace itself is the same without them."""
    import torch._subclasses.fake_tensor as fake_tensor

    saved = fake_tensor.traceback
    fake_tensor.traceback = _WithoutStacks()
    try:
        yield
    finally:
        fake_tensor.traceback = saved


class TapeBackend:
    """``StepGraphs``' backend on the CPU: record = trace with ``make_fx``; replay = run the trace."""

    runs_while_recording = True

    def __init__(self, device: torch.device | None = None, watch: Iterable[Any] = ()) -> None:
        self.device = device
        self.watch = list(watch)
        self.kept: list[str] = []
        self.traces = 0

    def eager(self, fn: Callable[[], Any]) -> Any:
        return fn()

    def record(self, fn: Callable[[], dict[str, Tensor]]) -> tuple[Callable[[], None], dict[str, Tensor]]:
        before = reachable_tensors(self.watch)
        holder: list[dict[str, Tensor]] = []

        def traced() -> list[Tensor]:
            out = fn()
            holder.append(out)
            return [out[k] for k in sorted(out)]

        with _no_mode_stacks():
            module = make_fx(traced)()
        self.traces += 1
        after = reachable_tensors(self.watch)
        self.kept = sorted(name for key, name in after.items() if key not in before)
        names = sorted(holder[0])
        outputs = {k: holder[0][k].detach().clone() for k in names}

        def replay() -> None:
            with torch.no_grad():
                for k, v in zip(names, module(), strict=True):
                    outputs[k].copy_(v)

        return replay, outputs
