"""Networks: layers, backbones, necks, heads, the Detector, model YAMLs and the model zoo."""

from yolokit.models.detector import Detector, ModelSummary, prefers_channels_last
from yolokit.models.graph import LayerGraph
from yolokit.models.spec_config import SpecConfig, SpecError, packaged_yamls
from yolokit.models.spec_table import ModuleRule, register_module, registered_modules, unregister_module
from yolokit.models.timm_backbone import TimmBackbone  # timm itself is imported when one is built
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
    "LayerGraph",
    "ModelSummary",
    "ModuleRule",
    "SpecConfig",
    "SpecError",
    "TimmBackbone",
    "YOLOv3Config",
    "YOLOv8Config",
    "build_model",
    "config_from_dict",
    "create_model",
    "list_models",
    "packaged_yamls",
    "prefers_channels_last",
    "register_module",
    "registered_modules",
    "unregister_module",
]
