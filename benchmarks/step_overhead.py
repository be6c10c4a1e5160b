"""Per-step overhead of yolov8n training at a tiny input on the CPU, before and after (issue 15).

At 64 px and batch 1 the arithmetic is small, so a step's time is mostly Python and
per-op dispatch: what a fast GPU leaves of a step. "Before" rebuilds the old per-step
code in this file: the EMA walking two state dicts tensor by tensor, the optimizer's
per-parameter loop (``foreach=False``), in-place SiLU. "After" is yolokit as it is:
``ModelEMA`` with ``torch._foreach_*`` over tensors paired once, ``build_optimizer``
(fused SGD / AdamW on the CPU), out-of-place SiLU. Not a test: run it on a quiet machine.

    python benchmarks/step_overhead.py
    python benchmarks/step_overhead.py --imgsz 32 --batch 2 --repeats 30

Rows (median ms of ``--repeats`` runs, before and after measured in turns, A B A B):
``step`` = forward (train mode) + YOLOv8Loss + backward + optimizer step + EMA update +
zero_grad; ``ema`` = one EMA update; ``sgd`` / ``adamw`` = one optimizer step on fixed
gradients; ``deterministic`` = the step under ``torch.use_deterministic_algorithms``
with PyTorch's NaN fill of new tensors (before) and with ``perf.configure(deterministic=True)``
(after, no fill). ``ops`` = operator calls dispatched from Python (a TorchDispatchMode
count): on a GPU each is one or more kernel launches.
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable

import torch
from harness.timing import Timed, alternate, header, median
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import yolokit
from yolokit.accel import perf
from yolokit.losses.yolov8 import YOLOv8Loss
from yolokit.train.ema import ModelEMA
from yolokit.train.optim import build_optimizer, parameter_groups


class LoopEMA(ModelEMA):
    """The old update: two state dicts built per step, two ops per floating tensor."""

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.updates += 1
        d = self.current_decay()
        source = model.state_dict()
        for name, value in self.module.state_dict().items():
            new = source[name].detach()
            if value.dtype.is_floating_point:
                value.mul_(d).add_(new.to(value.dtype), alpha=1 - d)
            else:
                value.copy_(new)


def loop_optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    """The old build_optimizer: torch's per-parameter loop (its CPU default)."""
    groups = parameter_groups(model, 5e-4)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=0.01, momentum=0.9, nesterov=True, foreach=False)
    return torch.optim.AdamW(groups, lr=0.001, betas=(0.9, 0.999), foreach=False)


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], object]) -> int:
    with _OpCounter() as counter:
        fn()
    return counter.ops


class Side:
    """One model with its loss, optimizer and EMA, in the old ("before") or the current form."""

    def __init__(self, base: nn.Module, *, before: bool, optimizer: str = "sgd"):
        self.model = copy.deepcopy(base).train()
        for m in self.model.modules():
            if isinstance(m, nn.SiLU):
                m.inplace = before
        head = self.model.head
        self.loss = YOLOv8Loss(head.num_classes, head.strides, reg_max=head.reg_max)
        self.optimizer = (loop_optimizer(self.model, optimizer) if before
                          else build_optimizer(self.model, optimizer, 0.01 if optimizer == "sgd" else 0.001,
                                               0.9, 5e-4))
        self.ema = (LoopEMA if before else ModelEMA)(self.model, 0.9999, 2000.0)
        self.net: nn.Module = self.model  # what the forward runs (a compiled wrapper, or the model)

    def step(self, images: torch.Tensor, targets: torch.Tensor) -> None:
        total, _ = self.loss(self.net(images), targets)
        total.backward()
        self.optimizer.step()
        self.ema.update(self.model)
        self.optimizer.zero_grad(set_to_none=True)

    def fill_grads(self) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        return [p.grad.clone() for p in params]

    def optimizer_step(self, saved: list[torch.Tensor]) -> Timed:
        """One optimizer step on the saved gradients (restored untimed: foreach SGD writes into them)."""
        grads = [p.grad for p in self.model.parameters() if p.requires_grad]
        torch._foreach_copy_(grads, saved)
        t0 = time.perf_counter()
        self.optimizer.step()
        return Timed(time.perf_counter() - t0, 1)


def row(label: str, runs: list[list[float]], ops: tuple[int, int] | None = None) -> str:
    before, after = median(runs[0]) * 1e3, median(runs[1]) * 1e3
    counts = f"   ops {ops[0]:>5} -> {ops[1]:<5}" if ops else ""
    return (f"{label:<14} before {before:8.2f} ms   after {after:8.2f} ms   ratio {after / before:5.2f}{counts}   "
            f"runs before {', '.join(f'{t * 1e3:.1f}' for t in runs[0])} | after "
            f"{', '.join(f'{t * 1e3:.1f}' for t in runs[1])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--imgsz", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--compile", action="store_true",
                        help="add a row: the after step eager vs its model torch.compile'd (inductor; minutes)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(header())
    print(f"yolov8n (2 classes), {args.imgsz} px, batch {args.batch}; median of {args.repeats} runs after "
          f"{args.warmup} warm-up rounds\n")

    torch.manual_seed(0)
    base = yolokit.create_model("yolov8n", num_classes=2)
    images = torch.rand(args.batch, 3, args.imgsz, args.imgsz, generator=torch.Generator().manual_seed(0))
    s = args.imgsz
    targets = torch.tensor([[i, i % 2, 0.1 * s, 0.1 * s, 0.6 * s, 0.7 * s] for i in range(args.batch)])
    before, after = Side(base, before=True), Side(base, before=False)
    timing = {"warmup": args.warmup, "repeats": args.repeats}

    runs = alternate([lambda: before.step(images, targets), lambda: after.step(images, targets)], **timing)
    print(row("step", runs), flush=True)

    ops = (count_ops(lambda: before.ema.update(before.model)), count_ops(lambda: after.ema.update(after.model)))
    runs = alternate([lambda: before.ema.update(before.model), lambda: after.ema.update(after.model)],
                     inner=10, **timing)
    print(row("ema", runs, ops), flush=True)

    for name in ("sgd", "adamw"):
        b, a = Side(base, before=True, optimizer=name), Side(base, before=False, optimizer=name)
        saved_b, saved_a = b.fill_grads(), a.fill_grads()
        b.optimizer_step(saved_b), a.optimizer_step(saved_a)  # the first step also makes the state
        ops = (count_ops(b.optimizer.step), count_ops(a.optimizer.step))
        runs = alternate([lambda b=b, saved_b=saved_b: b.optimizer_step(saved_b),
                          lambda a=a, saved_a=saved_a: a.optimizer_step(saved_a)],
                         inner=10, **timing)
        print(row(name, runs, ops), flush=True)

    def deterministic_step(side: Side, fill: bool) -> Timed:
        perf.configure(deterministic=True)
        torch.utils.deterministic.fill_uninitialized_memory = fill
        t0 = time.perf_counter()
        side.step(images, targets)
        elapsed = time.perf_counter() - t0
        perf.configure(deterministic=False)
        return Timed(elapsed, 1)

    runs = alternate([lambda: deterministic_step(after, True), lambda: deterministic_step(after, False)], **timing)
    print(row("deterministic", runs), flush=True)

    if args.compile:  # "before" = eager, "after" = compiled, both the current code
        compiled = Side(base, before=False)
        compiled.net = torch.compile(compiled.model)
        compiled.step(images, targets)  # compiles the forward and its backward
        runs = alternate([lambda: after.step(images, targets), lambda: compiled.step(images, targets)], **timing)
        print(row("compiled", runs), flush=True)


if __name__ == "__main__":
    main()
