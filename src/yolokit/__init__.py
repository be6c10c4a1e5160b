"""yolokit: YOLOv3 and YOLOv8 object detection in plain PyTorch.

Examples:
    >>> import yolokit
    >>> model = yolokit.create_model("yolov8n", num_classes=80)
    >>> from yolokit.predict import predict
    >>> results = predict(model, "path/to/images", conf=0.25)  # files, folders, videos, arrays
    >>> model = yolokit.load("yolov8n.pt")  # Ultralytics, Darknet (model=...) or yolokit files
    >>> yolokit.export(model, "onnx")        # also "openvino", "pt2"; yolokit.load runs the file again

The public names below, and every subpackage (``yolokit.train``, ``yolokit.data``,
``yolokit.accel``, ...), are imported on first use, so ``import yolokit.accel`` (in a
freshly spawned DDP worker, say) costs only torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "Detections": "yolokit.ops.nms",
    "Detector": "yolokit.models",
    "create_model": "yolokit.models",
    "list_models": "yolokit.models",
    "export": "yolokit.deploy",
    "load": "yolokit.deploy",
    "save": "yolokit.interop",
    "tune": "yolokit.train.sweeps",
}

SUBPACKAGES = ("accel", "data", "deploy", "interop", "losses", "models", "ops", "predict", "train", "val", "viz")

__all__ = ["Detections", "Detector", "__version__", "create_model", "export", "list_models", "load", "save", "tune",
           *SUBPACKAGES]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
    elif name in SUBPACKAGES:
        value = importlib.import_module(f"yolokit.{name}")
    else:
        raise AttributeError(f"module 'yolokit' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC) | set(SUBPACKAGES))
