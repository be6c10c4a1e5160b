"""Weights in and out of a run: pretrained starting points and the final inference file."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from yolokit.interop import load
from yolokit.interop.native import FORMAT, FORMAT_VERSION
from yolokit.models import Detector
from yolokit.train.checkpoint import atomic_save


def load_pretrained(model: Detector, path: str | Path) -> list[str]:
    """Copies every tensor of the file at ``path`` whose name and shape match into ``model``.

    Any format ``yolokit.load`` reads works (yolokit, Ultralytics, a run's checkpoint).
    Tensors that do not fit (the class layers when the class count differs) keep their
    fresh initialisation; they are named in a printed message.

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
        print(f"pretrained {path}: {len(kept)}/{len(target)} tensors loaded; "
              f"{len(skipped)} left as initialised{note}")
    return skipped


def class_names(path: str | Path) -> list[str] | None:
    """The class names stored in a run's inference file, or None for other files."""
    path = Path(path)
    if path.suffix not in (".pt", ".pth"):
        return None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # not a plain torch file (e.g. an Ultralytics pickle): no names
        return None
    names = obj.get("names") if isinstance(obj, dict) else None
    return [str(n) for n in names] if isinstance(names, list) else None


def export_final(model: Detector, path: str | Path, names: list[str], train_config: Any) -> Path:
    """The inference file of a run: fp16 weights + model config (yolokit format) + class names.

    ``yolokit.load(path)`` returns the ready model.
    """
    state = {k: (v.detach().half() if v.is_floating_point() else v.detach()).cpu().contiguous()
             for k, v in model.state_dict().items()}
    return atomic_save({"format": FORMAT, "format_version": FORMAT_VERSION, "config": asdict(model.config),
                        "state_dict": state, "names": list(names), "train_config": train_config.to_dict()}, path)
