"""Deploy: a trained model as a file another runtime runs, checked against the model, then run and
validated again.

Typical use:
    >>> import yolokit
    >>> path = yolokit.export(yolokit.load("best.pt"), "onnx", imgsz=640)   # doctest: +SKIP
    >>> exported = yolokit.load(path)                                        # doctest: +SKIP
    >>> exported.predict(images)                                             # doctest: +SKIP
"""

from __future__ import annotations

import os

import torch

from yolokit.deploy.exporter import FORMATS, TOLERANCES, check_export, export
from yolokit.deploy.runtime import ExportedModel, ExportError, format_of, load_exported
from yolokit.models import Detector

__all__ = ["ExportError", "ExportedModel", "FORMATS", "TOLERANCES", "check_export", "export", "format_of", "load",
           "load_exported"]


def load(path: str | os.PathLike, *, model: str | Detector | None = None,
         device: str | torch.device = "cpu") -> Detector | ExportedModel:
    """A ready model from any file yolokit reads: an exported file (``.onnx``, an OpenVINO folder,
    ``.pt2``) as an :class:`ExportedModel`, run by its runtime on ``device``; any weights file as a
    Detector on the CPU (``yolokit.interop.load``; ``model`` names or checks the variant).

    Examples:
        >>> yolokit.load("yolov8n.onnx").predict(torch.zeros(1, 3, 640, 640))[0].boxes.shape
        torch.Size([0, 4])
    """
    if format_of(path) is not None:
        if model is not None:
            raise ValueError(f"{path}: an exported file holds its own network; --model does not apply")
        return load_exported(path, device=device)
    from yolokit.interop import load as load_weights

    return load_weights(path, model=model)
