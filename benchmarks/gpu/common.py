"""What every section shares: settings, result rows with targets, the section clock, the training step."""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from harness import inputs
from harness.pipeline import dataset_yaml
from harness.timing import alternate, median

BOXES = 8  # boxes per synthetic image (random_targets), as in the other benchmarks
OPS = {">=": lambda v, b: v >= b, "<=": lambda v, b: v <= b, "==": lambda v, b: v == b}


@dataclass(frozen=True)
class Settings:
    """How big and how long: the GPU pass, or the CPU smoke run of the same code paths.

    Attributes:
        device: where everything runs (``cuda``; ``cpu`` for ``--cpu-smoke``).
        imgsz: square training size (640; 64 in the smoke run).
        smoke: tiny sizes, batch 2, 2 timed steps, no compile; numbers meaningless.
        warmup: untimed rounds before a timing.
        repeats: timed rounds (the median is reported).
        iters: steps per timed round.
        workers: data loader processes (the machine's cores, at most 16).
        out: the results' folder, where a section may write a file of its own (None: it writes none).
        cap: seconds each section may run instead of its ``CAPS`` entry (``--cap``; None: the entry).
    """

    device: torch.device
    imgsz: int
    smoke: bool
    warmup: int
    repeats: int
    iters: int
    workers: int
    out: Path | None = None
    cap: float | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def batch(self, n: int) -> int:
        """``n`` on the GPU, 2 in the smoke run."""
        return 2 if self.smoke else n


@dataclass
class Row:
    """One measurement of the table: a number, its unit, and the issue's target when it has one.

    ``value`` None means not measured; ``note`` then says why (out of memory, skipped).
    """

    section: str
    what: str
    value: float | None
    unit: str = ""
    target: tuple[str, float] | None = None
    note: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool | None:
        """Whether the value meets the target (None: no target, or no value)."""
        if self.target is None or self.value is None or (isinstance(self.value, float) and math.isnan(self.value)):
            return None
        op, bound = self.target
        return bool(OPS[op](self.value, bound))

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "target": None if self.target is None else list(self.target), "ok": self.ok}


def fmt(value: float | None, unit: str = "") -> str:
    """A number for the table: 3 significant digits, no exponent for large ones."""
    if value is None:
        return "-"
    if isinstance(value, int) or (abs(value) >= 1000 and float(value).is_integer()):
        text = f"{int(value)}"
    else:
        text = f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    return f"{text}{unit}" if unit in ("x", "%") else f"{text} {unit}".rstrip()


class Clock:
    """A section's time cap, checked between measurements (one measurement is never cut short)."""

    def __init__(self, section: str, cap_s: float) -> None:
        self.section, self.cap_s, self.start = section, cap_s, time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def over(self) -> bool:
        return self.elapsed() > self.cap_s

    def skipped(self, what: str) -> Row:
        return Row(self.section, what, None, note=f"skipped: the section's {self.cap_s:.0f} s cap was spent")


def free() -> None:
    """Garbage collected and, on CUDA, the allocator's cached blocks returned."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def attempt(fn: Callable[[], Any]) -> tuple[Any, str]:
    """``(fn(), "")``, or ``(None, "out of memory")`` when the device runs out; memory freed after."""
    from yolokit.accel import is_oom_error

    try:
        return fn(), ""
    except Exception as exc:
        if not is_oom_error(exc):
            raise
        return None, "out of memory"
    finally:
        free()


@contextlib.contextmanager
def tf32(enabled: bool | None) -> Iterator[None]:
    """TF32 in fp32 matmuls and convolutions on (True), off (False), or PyTorch's default (None: as it is)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    if enabled is not None:
        from yolokit.accel import configure

        configure(tf32=enabled)
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def shapes_yaml(s: Settings) -> Path:
    """The shapes set the loader and batch sections read: 2,048 training images at 640 (32 at 64 in the smoke run)."""
    return dataset_yaml(images=2048 if s.cuda else 32, imgsz=s.imgsz)


def default_channels_last(s: Settings) -> bool:
    """The library's layout for this device type (``models.prefers_channels_last``)."""
    from yolokit.models import prefers_channels_last

    return prefers_channels_last(s.device.type)


class TrainStep:
    """yolokit's training step on one synthetic batch held on the device, in the trainer's order.

    Forward under autocast, loss (``max_boxes`` given: no read-back), backward of
    ``loss * batch``, unscale / clip at norm 10 / SGD step without a read-back, zero grad.
    No EMA (the reference's step has none either).

    Args:
        s: the run's settings.
        name: a yolokit model name.
        batch: images per step (B).
        precision: ``fp32``, ``bf16`` or ``fp16``.
        channels_last: layout of weights and images; None: the library's default for the device.
        checkpoint: activation checkpointing of every backbone stage and neck block.
        compile: ``torch.compile`` the model (inductor; a string is the mode, "reduce-overhead": CUDA graphs)
            and the loss (the default mode), as ``TrainConfig.compile`` does.
        graphs: the whole step (forward, loss, backward, clipping, the optimizer's step) recorded as a CUDA
            graph and replayed, as ``TrainConfig(cuda_graphs=True)`` does (``yolokit.accel.graphs``): the
            boxes padded to their bucket, two eager steps, then the recording.
    """

    def __init__(self, s: Settings, name: str, batch: int, precision: str, *, channels_last: bool | None = None,
                 checkpoint: bool = False, compile: bool | str = False, graphs: bool = False) -> None:
        import yolokit
        from yolokit.accel import Precision, enable_activation_checkpointing, perf
        from yolokit.train import TrainConfig
        from yolokit.train.build import build_loss
        from yolokit.train.optim import build_optimizer

        self.batch = batch
        self.channels_last = default_channels_last(s) if channels_last is None else channels_last
        self.model = yolokit.create_model(name).to(s.device).train()
        if checkpoint:
            enable_activation_checkpointing(self.model.checkpoint_units("all"))
        perf.prepare_model(self.model, channels_last=self.channels_last)
        self.net = perf.prepare_model(self.model, compile=bool(compile),
                                      compile_mode=compile if isinstance(compile, str) else None)
        self.criterion = build_loss(self.model, TrainConfig())
        if compile:                     # as the trainer does: the loss too, sizes dynamic, the default mode
            self.criterion = perf.prepare_model(self.criterion, compile=True, compile_dynamic=True)
        self.optimizer = build_optimizer(self.model, "sgd", 0.01, 0.937, 5e-4)
        self.amp = Precision(precision, s.device)
        images = inputs.random_images(batch, s.imgsz).to(s.device)
        self.images = images.contiguous(memory_format=torch.channels_last) if self.channels_last else images
        self.targets = inputs.random_targets(batch, BOXES, s.imgsz).to(s.device)
        seg = getattr(self.model.head, "segments", False)   # a segmentation model: its masks, as the loader's
        self.masks = inputs.box_masks(self.targets.cpu(), batch, s.imgsz).to(s.device) if seg else None
        self.graphs = None
        if graphs:
            from yolokit.accel.graphs import StepGraphs, bucket
            from yolokit.losses.base import pad_targets
            from yolokit.train.step import GraphStep, baked_numbers

            padded = pad_targets(self.targets, batch, max_boxes=bucket(BOXES))
            self.graph_inputs = {"images": self.images, "labels": padded.labels, "boxes": padded.boxes,
                                 "mask": padded.mask}
            self.graphs = StepGraphs(GraphStep(self.net, self.criterion, self.amp, self.optimizer, 10.0), s.device)
            self.variant = (True, True, baked_numbers(self.optimizer, self.criterion))

    def __call__(self) -> None:
        if self.graphs is not None:
            self.graphs(self.graph_inputs, variant=self.variant)
            return
        self.forward_backward(self.images, self.targets, BOXES, self.batch)
        self.amp.step(self.optimizer, clip_grad_norm=10.0, blocking=False)
        self.optimizer.zero_grad(set_to_none=True)


    def forward_backward(self, images: torch.Tensor, targets: torch.Tensor, max_boxes: int,
                         weight: float) -> torch.Tensor:
        """The trainer's micro-batch step (``yolokit.train.step.forward_backward``); the detached loss."""
        from yolokit.train.step import forward_backward

        return forward_backward(self.net, self.criterion, self.amp, images, targets, max_boxes=max_boxes,
                                weight=weight, channels_last=self.channels_last, masks=self.masks)[0]


def images_per_second(s: Settings, fns: list[Callable[[], Any]], batch: int | list[int]) -> list[float]:
    """Images/s of each callable (one step of ``batch`` images), timed in turns A B A B (medians)."""
    batches = batch if isinstance(batch, list) else [batch] * len(fns)
    runs = alternate(fns, warmup=s.warmup, repeats=s.repeats, inner=s.iters, device=s.device)
    return [b / median(r) for b, r in zip(batches, runs, strict=True)]
