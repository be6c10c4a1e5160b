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

from functools import partial

import torch
from torch import Tensor, nn

from yolokit.accel import Precision
from yolokit.accel.oom import retry_step, run_batch
from yolokit.data import to_device
from yolokit.train.meter import LossMeter
from yolokit.train.state import Parts, Progress


def train_step(parts: Parts, progress: Progress, meter: LossMeter, batch: dict | None, epoch: int) -> bool:
    """This rank's next loader batch (None: its shard has ended) and, when the step is due, the update.

    Returns:
        Whether an optimizer step was taken.
    """
    acc, optimizer, precision = parts.accumulator, parts.optimizer, parts.precision
    if batch is not None:       # forward/backward of its micro-batches; out of memory: split finer, the step replayed
        meter.add(run_batch(acc, batch, partial(micro_step, parts, epoch, progress.step_in_epoch)))
    if not acc.step_due():                                    # this rank's batches of the step have all run
        return False
    with parts.stop.deferred():                               # a Ctrl-C waits for the end of the step
        acc.sync()                                            # gradients summed over ranks, BatchNorm combined
        parts.schedule.apply(optimizer, epoch, progress.iteration(parts.plan.steps_per_epoch))
        precision.unscale_(optimizer)                         # fp16: gradients in true units
        norm = precision.clip_grad_norm_(optimizer, parts.config.clip_grad_norm)
        retry_step(acc, precision.step, optimizer, norm, blocking=False)   # inf/NaN: skipped; OOM: once more
        optimizer.zero_grad(set_to_none=True)
        if parts.ema is not None:
            parts.ema.update(parts.model)
        progress.step_taken()
        meter.mark()                                          # the loss sums of the completed steps
    return True


def micro_step(parts: Parts, epoch: int, step: int, micro: dict) -> tuple[dict[str, Tensor], int]:
    """One micro-batch on the device at this step's size (multi-scale): forward, loss, backward of
    ``loss * images`` (Ultralytics' ``loss * batch``). Returns ``(loss parts, images)``."""
    data = to_device(micro, parts.plan.device, non_blocking=True, compiled=parts.settings.compile_augment)
    images, targets = parts.scale(data["images"], data["targets"], epoch, step)
    _, losses = forward_backward(parts.train_net, parts.criterion, parts.precision, images, targets,
                                 max_boxes=micro["max_boxes"], weight=len(images),
                                 channels_last=parts.settings.channels_last)
    return losses, len(images)


def forward_backward(net: nn.Module, criterion: nn.Module, precision: Precision, images: Tensor, targets: Tensor,
                     *, max_boxes: int | None, weight: float, channels_last: bool) -> tuple[Tensor, dict[str, Tensor]]:
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

    Returns:
        ``(loss, parts)``: the unweighted loss, detached, and the loss's named parts.
    """
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    with precision.autocast():
        loss, parts = criterion(net(images), targets, max_boxes=max_boxes)
    precision.backward(loss * weight)
    return loss.detach(), parts
