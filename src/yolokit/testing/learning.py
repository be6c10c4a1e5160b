"""``assert_learns``: a model fits one fixed batch better after a few steps, every parameter taking part."""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor, nn

    from yolokit.data import DetectionDataset
    from yolokit.models import Detector


@dataclass(frozen=True)
class LearningCurve:
    """What :func:`assert_learns` saw.

    Attributes:
        losses: the loss at each step, before its update.
        fit: the batch's fit before the first step and after the last (see :func:`assert_learns`).
    """

    losses: list[float]
    fit: tuple[float, float]


def _fixed_batch(data: Any, batch: int, imgsz: int) -> dict:
    """The first ``batch`` images of the training split that hold a box, collated (letterboxed, no
    augmentation); a dict with ``images`` and ``targets`` is taken as it is."""
    from yolokit.data import DetectionDataset, collate

    if isinstance(data, Mapping):
        return dict(data)
    dataset = data if isinstance(data, DetectionDataset) else DetectionDataset(data, "train", imgsz=imgsz)
    items = []
    for i in range(len(dataset)):
        item = dataset[i]
        if len(item["boxes"]):
            items.append(item)
        if len(items) == batch:
            break
    if not items:
        raise ValueError(f"{data}: no image of the training split holds a box")
    return collate(items)


def _fit(model: nn.Module, images: Tensor, targets: Tensor) -> float:
    """Mean over the ground-truth boxes of max over predictions of (score of the box's class x IoU): 0 for a
    model that finds nothing, 1 for one that predicts each box exactly, at score 1."""
    import torch

    from yolokit.ops import box_iou

    with torch.no_grad():
        predictions = model.decode(model(images))   # [B, P, 4 + C]
    best = [(predictions[int(i), :, 4 + int(c)] * box_iou(predictions[int(i), :, :4], box[None])[:, 0]).max()
            for i, c, box in zip(targets[:, 0], targets[:, 1], targets[:, 2:], strict=True)]
    return float(torch.stack(best).mean()) if best else 0.0


def _unwired(net: nn.Module, images: Tensor, trainable: list[tuple[str, Tensor]], seed: int) -> list[str]:
    """The trainable parameters that get no gradient (None, or zero everywhere) from one backward pass of a
    random weighting of every output map: those of blocks whose output does not reach the model's output."""
    import torch

    outputs, found = [], [net(images)]
    while found:   # the maps, however the head nests them (lists, the end-to-end head's dict)
        x = found.pop()
        if isinstance(x, torch.Tensor):
            outputs.append(x)
        elif isinstance(x, Mapping):
            found += x.values()
        elif isinstance(x, (list, tuple)):
            found += x
    generator = torch.Generator().manual_seed(seed)
    sum((m * torch.randn(m.shape, generator=generator).to(m)).sum() for m in outputs).backward()
    missing = [name for name, p in trainable if p.grad is None or not p.grad.any()]
    net.zero_grad(set_to_none=True)
    return missing


def _adam_step(params: list[Tensor], moments: list[tuple[Tensor, Tensor]], *, lr: float, step: int,
               betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
    """One Adam update (``torch.optim.Adam``'s rule, without weight decay), written out: building a
    ``torch.optim`` optimizer imports ``torch._dynamo``, seconds of a test session's start."""
    import torch

    with torch.no_grad():
        for p, (mean, square) in zip(params, moments, strict=True):
            if p.grad is not None:
                mean.lerp_(p.grad, 1 - betas[0])
                square.mul_(betas[1]).addcmul_(p.grad, p.grad, value=1 - betas[1])
                denominator = (square / (1 - betas[1] ** step)).sqrt_().add_(eps)
                p.addcdiv_(mean, denominator, value=-lr / (1 - betas[0] ** step))


def assert_learns(model: Detector, data: str | os.PathLike | DetectionDataset | Mapping[str, Any], *,
                  steps: int = 15, batch: int = 4, imgsz: int = 64, lr: float = 0.01, min_gain: float = 0.02,
                  loss: nn.Module | None = None, seed: int = 0) -> LearningCurve:
    """Assert a model learns: every trainable parameter is wired to the output, and Adam steps on one fixed
    batch fit it better.

    A copy of ``model`` (``model`` is left as it is) trains on the first ``batch`` images of ``data``'s
    training split that hold a box (letterboxed, not augmented), the same batch every step, with the loss the
    trainer builds for its head (YOLOv8, YOLO26 or YOLOv3) unless ``loss`` is given. Deterministic; the global
    random state is left as it was. The checks, reported together:

    - every trainable parameter gets a gradient, nonzero somewhere, from a random weighting of every output
      map (one backward pass, before training): one that does not belongs to a block the forward pass does
      not use, or whose output nothing reads (a detached or discarded branch);
    - every loss and gradient of the steps is finite;
    - the batch's *fit* rose by ``min_gain``: the mean over its boxes of the best (score of the box's class x
      IoU) among the decoded predictions, in [0, 1]. Not the loss: the task-aligned assigner (YOLOv8, YOLO26)
      gives a fresh model's predictions almost no weight, so their loss rises over the first dozens of steps
      while the model learns.

    Args:
        model: a ``Detector`` (any model with ``decode``), on the device to train on.
        data: a data.yaml path (such as the ``yolokit_shapes`` fixture), a ``DetectionDataset``, or a batch
            dict with ``images`` Tensor[B, 3, H, W] in [0, 1] and ``targets`` Tensor[N, 6].
        steps: optimizer steps.
        batch: images in the batch.
        imgsz: the images' size (a data.yaml path only).
        lr: Adam's learning rate (high, to overfit in few steps).
        min_gain: the least rise of the fit.
        loss: a loss module ``loss(maps, targets) -> (total, parts)``, instead of the head's.
        seed: seeds the output weighting and torch's generator for the run (layers that draw random numbers).

    Returns:
        The losses and the fit before and after.

    Raises:
        AssertionError: naming the parameters without a gradient, those with a non-finite one, a non-finite
            loss, the fit before and after; with the losses.
    """
    import torch

    from yolokit.train import TrainConfig
    from yolokit.train.build import build_loss

    device = next(model.parameters()).device
    fixed = _fixed_batch(data, batch, imgsz)
    images, targets = fixed["images"].to(device).float(), fixed["targets"].to(device).float()
    net = copy.deepcopy(model).train()
    criterion = loss if loss is not None else build_loss(net, TrainConfig())
    trainable = [(name, p) for name, p in net.named_parameters() if p.requires_grad]
    broken, losses = set(), []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        missing = _unwired(net, images, trainable, seed)
        moments = [(torch.zeros_like(p), torch.zeros_like(p)) for _, p in trainable]
        before = _fit(net, images, targets)
        for step in range(1, steps + 1):
            net.zero_grad(set_to_none=True)
            total = criterion(net(images), targets)[0].sum()
            losses.append(total.item())
            if not math.isfinite(losses[-1]):
                break
            total.backward()
            broken |= {name for name, p in trainable if p.grad is not None and not p.grad.isfinite().all()}
            _adam_step([p for _, p in trainable], moments, lr=lr, step=step)
        after = _fit(net, images, targets)
    problems = []
    if missing:
        problems.append(f"{len(missing)} of {len(trainable)} trainable parameters get no gradient from the "
                        f"output (is their block in the forward pass?): {', '.join(missing)}")
    if losses and not math.isfinite(losses[-1]):
        problems.append(f"the loss is {losses[-1]} at step {len(losses) - 1}")
    if broken:
        problems.append(f"non-finite gradients: {', '.join(n for n, _ in trainable if n in broken)}")
    if after - before < min_gain:
        problems.append(f"the fit rose from {before:.4f} to {after:.4f} in {len(losses)} steps (needs +{min_gain})")
    if problems:
        shown = ", ".join(f"{v:.4g}" for v in losses)
        raise AssertionError("the model does not learn the batch:\n  " + "\n  ".join(problems)
                             + f"\n  losses: {shown}")
    return LearningCurve(losses, (before, after))
