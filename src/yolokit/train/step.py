"""The training step, in one place: forward/backward of the micro-batches, then the optimizer step.

:func:`train_step` is what the trainer runs for every loader batch; each accel action
stands on its own line, in the order it acts.

What a step means does not depend on the number of processes: ``batch`` is the total over
all processes (each runs ``batch / world`` images per loader batch); an optimizer step
accumulates ``round(nbs / batch)`` loader batches per process; the losses are normalized
per batch and the step backpropagates ``loss * images`` of each micro-batch (as
Ultralytics does, so YOLOv8 SGD learning rates mean the same), summed over micro-batches
and processes; weight decay is scaled by ``effective batch / nbs``; the learning-rate
schedule counts optimizer steps. N processes therefore take the steps one process takes
over the same micro-batches (:class:`yolokit.data.ShardedBatchSampler` hands them out,
:class:`yolokit.accel.Accumulator` sums them), and validation covers the whole split. :func:`forward_backward` is one
micro-batch's forward, loss and backward, shared with the batch finder's probe and the GPU
benchmarks. A loader batch runs as micro-batches through :func:`yolokit.accel.oom.run_batch`,
which survives out of memory (the step's batches run again, split finer).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Hashable, Iterator
from functools import partial

import torch
from torch import Tensor, nn

from yolokit.accel import Precision, distributed
from yolokit.accel.agreement import first_failure
from yolokit.accel.graphs import GraphCaptureError, StepGraphs, backend_for, bucket
from yolokit.accel.oom import free_memory, is_oom_error, retry_step, run_batch
from yolokit.data import to_device
from yolokit.data.store.remote import StoreError, StoreStopped, one_line
from yolokit.losses.base import PaddedTargets, pad_targets
from yolokit.train.config import TrainConfig
from yolokit.train.meter import LossMeter
from yolokit.train.state import Parts, Progress


def train_step(parts: Parts, progress: Progress, meter: LossMeter, batch: dict | None, epoch: int) -> bool:
    """This rank's next loader batch (None: its shard has ended) and, when the step is due, the update.

    Returns:
        Whether an optimizer step was taken.
    """
    acc, optimizer, precision = parts.accumulator, parts.optimizer, parts.precision
    graphs = parts.graphs if parts.graphs is not None and parts.graphs.failed is None else None
    if graphs is not None and batch is not None and acc.splits == 1:
        stepped = graphed_step(parts, graphs, progress, meter, batch, epoch)
        if stepped is not None:
            return stepped
    if graphs is not None and batch is not None and not acc.held:   # the graphs leave gradients: a step starts at 0
        optimizer.zero_grad(set_to_none=False)
    if batch is not None:       # forward/backward of its micro-batches; out of memory: split finer, the step replayed
        meter.add(run_batch(acc, batch, partial(micro_step, parts, epoch, progress.step_in_epoch)))
    if not acc.step_due():                                    # this rank's batches of the step have all run
        return False
    if parts.data_check:                                      # a rank whose data stopped says so here: all stop
        data_came(None)                                       # before the step's gradients are exchanged
    with parts.stop.deferred():                               # a Ctrl-C waits for the end of the step
        acc.sync()                                            # gradients summed over ranks, BatchNorm combined
        parts.schedule.apply(optimizer, epoch, progress.iteration(parts.plan.steps_per_epoch))
        precision.unscale_(optimizer)                         # fp16: gradients in true units
        norm = precision.clip_grad_norm_(optimizer, parts.config.clip_grad_norm)
        retry_step(acc, precision.step, optimizer, norm, blocking=False)   # inf/NaN: skipped; OOM: once more
        optimizer.zero_grad(set_to_none=graphs is None)   # graphs: they stay, not made again inside a recording
        if parts.ema is not None:
            parts.ema.update(parts.model)
        progress.step_taken()
        meter.mark()                                          # the loss sums of the completed steps
    return True


def data_came(stopped: BaseException | None) -> None:
    """Several processes reading a remote store: every rank, at the same point of each step, says whether
    its data came (``stopped``: the StoreError its loader raised). When one rank's did not, every rank raises
    ``StoreStopped`` with the first failing rank's message, before any gradient of the step is exchanged,
    so each is at the last step all of them finished (``accel.agreement.first_failure``)."""
    failure = first_failure(None if stopped is None else one_line(stopped))
    if failure is not None:
        raise StoreStopped.of(failure, distributed.rank())


def loader_batches(parts: Parts) -> Iterator[dict]:
    """The loader's batches. Several processes on a remote store (``parts.data_check``): a rank whose data
    stopped says so at the step it is in (``data_came``), and every rank stops there."""
    batches = iter(parts.loader)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except StoreError as exc:
            if not parts.data_check:
                raise
            data_came(exc)                    # raises, on every rank
        yield batch


def micro_step(parts: Parts, epoch: int, step: int, micro: dict) -> tuple[dict[str, Tensor], int]:
    """One micro-batch on the device at this step's size (multi-scale): forward, loss, backward of
    ``loss * images`` (Ultralytics' ``loss * batch``). Returns ``(loss parts, images)``."""
    images, targets, masks = on_device(parts, epoch, step, micro)
    _, losses = forward_backward(parts.train_net, parts.criterion, parts.precision, images, targets,
                                 max_boxes=micro["max_boxes"], weight=len(images),
                                 channels_last=parts.settings.channels_last, masks=masks)
    return losses, len(images)


def on_device(parts: Parts, epoch: int, step: int, micro: dict) -> tuple[Tensor, Tensor, Tensor | None]:
    """A micro-batch's images (in the run's layout, at this step's size), targets and a segmentation batch's
    masks (None for a detection batch) on the device. Multi-scale resizes the images and boxes only: the masks
    stay at their size, which the mask loss reads as fractions of the image."""
    data = to_device(micro, parts.plan.device, non_blocking=True, compiled=parts.settings.compile_augment)
    images, targets = parts.scale(data["images"], data["targets"], epoch, step)
    if parts.settings.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    return images, targets, data.get("masks")


def forward_backward(net: nn.Module, criterion: nn.Module, precision: Precision, images: Tensor, targets: Tensor,
                     *, max_boxes: int | None, weight: float, channels_last: bool, masks: Tensor | None = None,
                     ) -> tuple[Tensor, dict[str, Tensor]]:
    """Backpropagates ``loss * weight`` of one micro-batch under ``precision``.

    Args:
        net: the network to train (possibly compiled).
        criterion: ``criterion(maps, targets, max_boxes=...)`` -> ``(loss, parts)``.
        precision: autocast and (scaled) backward.
        images: Tensor[B, 3, H, W] float on the device.
        targets: Tensor[N, 6] on the device.
        max_boxes: most boxes of one image in the batch (the loss pads to it), or None.
        weight: this micro-batch's share of the step (the trainer passes its image count).
        channels_last: lay the images out NHWC first.
        masks: a segmentation batch's masks (``DetectionDataset(segments=True)``), passed to the criterion.

    Returns:
        ``(loss, parts)``: the unweighted loss, detached, and the loss's named parts.
    """
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    with precision.autocast():
        extra = {} if masks is None else {"masks": masks}
        loss, parts = criterion(net(images), targets, max_boxes=max_boxes, **extra)
    precision.backward(loss * weight)
    return loss.detach(), parts


# --- the step as a CUDA graph ------------------------------------------------------------------------------

def graphs_off_reason(config: TrainConfig, *, device: torch.device, world: int, criterion: nn.Module,
                      optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``TrainConfig.cuda_graphs`` cannot record this run's step (None: it can)."""
    if backend_for(device) is None:
        return f"they need a CUDA device, this run trains on {device.type}"
    if world > 1:
        return "several processes exchange gradients on the host's schedule, which a graph does not record"
    if getattr(getattr(criterion, "_orig_mod", criterion), "num_masks", None):
        return "a segmentation loss takes masks, which the recorded step does not carry yet"
    if not getattr(criterion, "takes_padded_targets", False):
        loss = type(getattr(criterion, "_orig_mod", criterion)).__name__
        return f"{loss} takes its targets as rows, whose number changes from batch to batch"
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return (f"{type(optimizer).__name__} decides on the host whether to step (only torch's fused SGD and "
                "AdamW skip on the device)")
    if config.compile == "reduce-overhead":
        return "torch.compile's reduce-overhead records graphs of its own"
    return None


class GraphStep:
    """One loader batch as :class:`yolokit.accel.graphs.StepGraphs` records it.

    ``variant = (first, last, ...)``: the step's first batch zeroes the gradients (in place: a
    graph keeps them from step to step), every batch backpropagates ``loss * images``, and the
    step's last batch unscales, clips and steps the optimizer (fused: a step with inf/NaN
    gradients is skipped on the device). The rest of the variant is the numbers it bakes in
    (each group's lr, momentum and decay, the loss's own): read by :func:`graphed_step`.
    """

    def __init__(self, train_net: nn.Module, criterion: nn.Module, precision: Precision,
                 optimizer: torch.optim.Optimizer, clip_grad_norm: float | None) -> None:
        self.train_net, self.criterion, self.precision, self.optimizer = train_net, criterion, precision, optimizer
        self.clip_grad_norm = clip_grad_norm

    def __call__(self, variant: tuple, images: Tensor, labels: Tensor, boxes: Tensor,
                 mask: Tensor) -> dict[str, Tensor]:
        first, last = variant[0], variant[1]
        if first:
            self.optimizer.zero_grad(set_to_none=False)
        _, losses = forward_backward(self.train_net, self.criterion, self.precision, images,
                                     PaddedTargets(labels, boxes, mask), max_boxes=None,
                                     weight=images.shape[0], channels_last=False)
        if last:
            self.precision.unscale_(self.optimizer)
            norm = self.precision.clip_grad_norm_(self.optimizer, self.clip_grad_norm)
            self.precision.step(self.optimizer, norm, blocking=False)   # Adam(W): capturable while recorded
        return losses


def baked_numbers(optimizer: torch.optim.Optimizer, criterion: nn.Module) -> Hashable:
    """The Python numbers a recorded optimizer step and loss keep: each group's hyperparameters, the loss's."""
    groups = tuple(tuple((k, v) for k, v in sorted(g.items()) if isinstance(v, (int, float, tuple, bool)))
                   for g in optimizer.param_groups)
    own = getattr(criterion, "baked_numbers", None)
    return groups, tuple(own()) if callable(own) else ()


def graphed_step(parts: Parts, graphs: StepGraphs, progress: Progress, meter: LossMeter, batch: dict,
                 epoch: int) -> bool | None:
    """``train_step`` of one loader batch through the step's CUDA graphs (None: the graphs failed;
    the caller runs the batch eagerly, as the rest of the run)."""
    acc, optimizer = parts.accumulator, parts.optimizer
    first, last = not acc.held, acc.completes_step()
    images, targets, _ = on_device(parts, epoch, progress.step_in_epoch, batch)   # no seg loss is graphed
    padded = pad_targets(targets, len(images), max_boxes=bucket(batch["max_boxes"]))   # a few static sizes
    variant: tuple = (first, last)
    if last:   # the step's numbers, before it is recorded or replayed with them
        parts.schedule.apply(optimizer, epoch, progress.iteration(parts.plan.steps_per_epoch))
        variant += (baked_numbers(optimizer, parts.criterion),)
    inputs = {"images": images, "labels": padded.labels, "boxes": padded.boxes, "mask": padded.mask}
    with parts.stop.deferred() if last else contextlib.nullcontext():
        try:
            losses = graphs(inputs, variant=variant)
        except Exception as exc:
            if not (isinstance(exc, GraphCaptureError) or is_oom_error(exc)):
                raise
            failure = exc
        else:
            failure = None
            meter.add([(losses, len(images))])
            acc.ran(batch)
            if last:
                acc.sync()                                        # one process: BatchNorm statistics marked
                if parts.ema is not None:
                    parts.ema.update(parts.model)
                progress.step_taken()
                meter.mark()
    if failure is None:
        return last
    # the step goes on eagerly, from its first batch: what the graphs did of it is dropped
    graphs.failed = f"{type(failure).__name__}: {failure}".splitlines()[0]
    graphs.clear()
    parts.precision.reset_step()
    held = list(acc.held)
    acc.rewind()
    free_memory()
    warnings.warn(f"CUDA graphs are off for the rest of this run ({graphs.failed}); the step runs eagerly",
                  RuntimeWarning, stacklevel=3)
    for earlier in held:   # counted by the meter already
        run_batch(acc, earlier, partial(micro_step, parts, epoch, progress.step_in_epoch))
    return None
