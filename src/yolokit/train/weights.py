"""Weights in and out of a run: pretrained starting points (they bring their variant) and the
final inference file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from yolokit.interop import load, save
from yolokit.interop.native import TORCH_SUFFIXES, native_contents
from yolokit.interop.state import is_fused
from yolokit.models import Detector, create_model
from yolokit.models.zoo import is_yaml_name, packaged_model
from yolokit.train.files import atomic_save

DEFAULT_MODEL = "yolov8n"


def read_pretrained(path: str | Path, model: str | None = None) -> Detector:
    """The model held by a weights file, its variant read from the file.

    yolokit files store their config, Ultralytics checkpoints give their variant through
    their tensor shapes, Darknet files through their size (``model`` picks among variants of
    the same size).

    Args:
        path: any file ``yolokit.load`` reads (yolokit, a run's checkpoint, Ultralytics, Darknet).
        model: the variant asked for, or None to take the file's.

    Raises:
        ValueError: ``model`` contradicts the file (the message names both), the file holds
            fused weights, or it cannot be read.
    """
    try:
        source = load(path)
    except ValueError:
        if model is None:
            raise
        source = load(path, model=model)   # a Darknet file whose size fits several variants
    wanted = (create_model(model, num_classes=1).name if model is not None and (is_yaml_name(model) or
              packaged_model(model)) else model)
    if wanted is not None and wanted != source.name:
        raise ValueError(f"model {model!r} contradicts the weights {path}, which hold a {source.name}: leave "
                         f"--model out to train a {source.name} from them, or pass --model {source.name}")
    if is_fused(source.state_dict()):
        raise ValueError(f"{path}: holds fused weights (batch norms folded into the convolutions for "
                         "inference), which cannot train; use a run's last.pt, best.pt or model.pt")
    return source


def transfer_weights(model: Detector, source: Detector, *, path: str | Path = "weights",
                     report: Callable[[str], None] = print) -> list[str]:
    """Copies ``source``'s weights into ``model`` (the same variant), all but what the class count changes.

    With another class count only the class-score outputs stay as initialised: YOLOv8's
    ``head.cls.*.2`` convolutions (YOLO26's also ``head.one2one_cls.*.2``); of YOLOv3's output
    convolutions, which hold per anchor ``(tx, ty, tw, th, obj, classes...)``, the box and
    objectness rows transfer and the class rows do not. ``report`` (print by default) receives one
    line that counts the parameters transferred and names what was left out, and why.

    Returns:
        Names of the tensors not (or not wholly) transferred.
    """
    if source.name != model.name:
        raise ValueError(f"{path}: holds a {source.name}, not a {model.name}")
    src, dst = source.state_dict(), model.state_dict()
    new_classes = source.num_classes != model.num_classes
    merged, classes, partial, missing, other = {}, [], [], [], []
    for name, target in dst.items():
        value = src.get(name)
        if value is None:
            missing.append(name)
        elif value.shape == target.shape:
            merged[name] = value
        elif new_classes and name.split(".")[1] in ("cls", "one2one_cls") and name.split(".")[3] == "2":
            classes.append(name)                                   # YOLOv8's (and YOLO26's two) class scores
        elif new_classes and name.startswith("head.preds."):       # YOLOv3: box and objectness rows transfer
            merged[name] = _anchor_rows(value, target, len(model.head.anchors[0]))
            partial.append(name)
        else:
            other.append(name)
    model.load_state_dict({**dst, **merged})
    params = dict(model.named_parameters())
    total = sum(p.numel() for p in params.values())
    fresh = sum(params[k].numel() for k in classes + missing + other if k in params)
    fresh += sum(params[k].numel() // params[k].shape[0] * len(model.head.anchors[0]) * model.num_classes
                 for k in partial if k in params)     # the class rows of each anchor
    reasons = []
    if new_classes:
        layers = ("the class rows of head.preds.*" if not classes else "head.cls.*.2 and head.one2one_cls.*.2"
                  if any(".one2one_cls." in k for k in classes) else "head.cls.*.2")
        reasons.append(f"{layers} (class scores: the weights have {source.num_classes} classes, "
                       f"the data {model.num_classes})")
    if missing:
        reasons.append(f"{len(missing)} tensors the file lacks ({', '.join(missing[:3])}...)")
    if other:
        reasons.append(f"{len(other)} tensors of another shape ({', '.join(other[:3])}...)")
    line = f"pretrained {path} ({source.name}): {total - fresh:,}/{total:,} parameters transferred"
    report(line + (f"; left as initialised: {'; '.join(reasons)}" if reasons else ""))
    return classes + partial + missing + other


def _anchor_rows(value: torch.Tensor, target: torch.Tensor, anchors: int) -> torch.Tensor:
    """``target`` with the box and objectness rows of each anchor taken from ``value`` (YOLOv3 outputs)."""
    out = target.clone()
    old, new = value.shape[0] // anchors, target.shape[0] // anchors
    for a in range(anchors):
        out[a * new:a * new + 5] = value[a * old:a * old + 5]
    return out


def export_final(model: Detector, path: str | Path, names: list[str], train_config: Any,
                 extra: dict[str, Any] | None = None) -> Path:
    """An inference file of a run (``model.pt``, ``best.pt``): float16 weights, the model config,
    class names, the training config and ``extra``, written by ``yolokit.save`` (yolokit's own
    format; ``yolokit.load(path)`` returns the ready model). A failure is a ``SaveError``; the file
    that was there stays."""
    entries = {"train_config": train_config.to_dict(), **(extra or {})}
    if Path(path).suffix not in TORCH_SUFFIXES:
        return save(model, path, names=names, half=True, extra=entries)
    return atomic_save(native_contents(model, names=names, half=True, extra=entries, source=path), path)
