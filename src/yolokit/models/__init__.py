"""Networks: layers, backbones, necks, heads, the Detector and the model zoo."""

from yolokit.models.detector import Detector, ModelSummary, prefers_channels_last
from yolokit.models.zoo import (
    MODELS,
    YOLOv3Config,
    YOLOv8Config,
    build_model,
    config_from_dict,
    create_model,
    list_models,
)

__all__ = [
    "MODELS",
    "Detector",
    "ModelSummary",
    "YOLOv3Config",
    "YOLOv8Config",
    "build_model",
    "config_from_dict",
    "create_model",
    "list_models",
    "prefers_channels_last",
]
