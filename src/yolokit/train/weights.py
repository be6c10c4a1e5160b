"""Weights in and out of a run: pretrained starting points and the final inference file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from yolokit.interop import load, save
from yolokit.models import Detector


def load_pretrained(model: Detector, path: str | Path, *, report: Callable[[str], None] = print) -> list[str]:
    """Copies every tensor of the file at ``path`` whose name and shape match into ``model``.

    Any format ``yolokit.load`` reads works (yolokit, Ultralytics, a run's checkpoint).
    Tensors that do not fit (the class layers when the class count differs) keep their
    fresh initialisation; ``report`` (print by default) receives a line that counts them.

    Returns:
        Names of the tensors left as initialised.
    """
    source = load(path).state_dict()
    target = model.state_dict()
    if not set(source) & set(target):
        raise ValueError(f"{path}: no tensor of these weights matches {model.name}")
    kept = {k: v for k, v in source.items() if k in target and v.shape == target[k].shape}
    model.load_state_dict({**target, **kept})
    skipped = [k for k in target if k not in kept]
    head_classes = next((v.shape[0] for k, v in source.items() if k.startswith("head.cls.") and k.endswith(".2.weight")),
                        None)
    if skipped:
        note = (f" (the weights have {head_classes} classes, the data {model.num_classes})"
                if head_classes not in (None, model.num_classes) else "")
        report(f"pretrained {path}: {len(kept)}/{len(target)} tensors loaded; "
              f"{len(skipped)} left as initialised{note}")
    return skipped


def export_final(model: Detector, path: str | Path, names: list[str], train_config: Any) -> Path:
    """The inference file of a run: float16 weights, the model config, class names and the
    training config, written by ``yolokit.save`` (yolokit's own format; ``yolokit.load(path)``
    returns the ready model)."""
    return save(model, path, names=names, half=True, extra={"train_config": train_config.to_dict()})
