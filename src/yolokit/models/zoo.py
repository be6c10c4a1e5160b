"""Variants as data, and the builders ``create_model`` / ``list_models``.

A YOLOv8 size is three numbers (depth, width, max channels); a YOLOv3 variant is its
form and anchors. ``build_model(config)`` turns any config into a ``Detector`` and
``config_from_dict(asdict(config))`` gives the config back, as checkpoints store it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from yolokit.models.backbones import CSPDarknet, Darknet53, DarknetTiny
from yolokit.models.detector import Detector
from yolokit.models.heads import AnchorHead, DFLHead
from yolokit.models.necks import YOLOv3FPN, YOLOv3TinyFPN, YOLOv8PAN

Anchors = tuple[tuple[tuple[int, int], ...], ...]

COCO_ANCHORS: Anchors = (
    ((10, 13), (16, 30), (33, 23)),
    ((30, 61), (62, 45), (59, 119)),
    ((116, 90), (156, 198), (373, 326)),
)
# Darknet's yolov3-tiny.cfg: anchors (10,14) (23,27) (37,58) (81,82) (135,169) (344,319);
# the stride-16 level uses masks 1,2,3 and the stride-32 level masks 3,4,5.
TINY_ANCHORS: Anchors = (
    ((23, 27), (37, 58), (81, 82)),
    ((81, 82), (135, 169), (344, 319)),
)


@dataclass(frozen=True)
class YOLOv8Config:
    """A YOLOv8 size: channels ``min(c, max_channels) * width`` (multiple of 8), depths ``round(n * depth)``."""

    name: str
    depth: float
    width: float
    max_channels: int
    num_classes: int = 80
    reg_max: int = 16
    family: str = "yolov8"


@dataclass(frozen=True)
class YOLOv3Config:
    """A YOLOv3 variant: ``form`` is "full", "spp" or "tiny"; anchors per level in pixels."""

    name: str
    form: str
    anchors: Anchors
    num_classes: int = 80
    family: str = "yolov3"


MODELS: dict[str, YOLOv8Config | YOLOv3Config] = {
    "yolov3": YOLOv3Config("yolov3", "full", COCO_ANCHORS),
    "yolov3-spp": YOLOv3Config("yolov3-spp", "spp", COCO_ANCHORS),
    "yolov3-tiny": YOLOv3Config("yolov3-tiny", "tiny", TINY_ANCHORS),
    "yolov8n": YOLOv8Config("yolov8n", 0.33, 0.25, 1024),
    "yolov8s": YOLOv8Config("yolov8s", 0.33, 0.50, 1024),
    "yolov8m": YOLOv8Config("yolov8m", 0.67, 0.75, 768),
    "yolov8l": YOLOv8Config("yolov8l", 1.00, 1.00, 512),
    "yolov8x": YOLOv8Config("yolov8x", 1.00, 1.25, 512),
}


def list_models() -> list[str]:
    """Names accepted by ``create_model``."""
    return list(MODELS)


def create_model(name: str, *, num_classes: int = 80) -> Detector:
    """A freshly initialised variant.

    Example:
        >>> model = create_model("yolov8n", num_classes=3)
        >>> [m.shape for m in model(torch.zeros(1, 3, 64, 64))]
        [torch.Size([1, 67, 8, 8]), torch.Size([1, 67, 4, 4]), torch.Size([1, 67, 2, 2])]
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(MODELS)}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    return build_model(replace(MODELS[name], num_classes=num_classes))


def config_from_dict(data: dict[str, Any]) -> YOLOv8Config | YOLOv3Config:
    """Inverse of ``dataclasses.asdict`` for model configs (lists become tuples)."""
    family = data.get("family")
    cls = {"yolov8": YOLOv8Config, "yolov3": YOLOv3Config}.get(family)
    if cls is None:
        raise ValueError(f"model config has unknown family {family!r}")
    known = {f.name for f in fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"unknown {family} config fields: {sorted(unknown)}")
    values = dict(data)
    if "anchors" in values:
        values["anchors"] = tuple(tuple(tuple(int(v) for v in a) for a in level) for level in values["anchors"])
    return cls(**values)


def _channels(c: int, cfg: YOLOv8Config) -> int:
    return math.ceil(min(c, cfg.max_channels) * cfg.width / 8) * 8


def _depth(n: int, cfg: YOLOv8Config) -> int:
    return max(round(n * cfg.depth), 1)


def build_model(config: YOLOv8Config | YOLOv3Config) -> Detector:
    """A ``Detector`` built from a config."""
    if isinstance(config, YOLOv8Config):
        widths = tuple(_channels(c, config) for c in (64, 128, 256, 512, 1024))
        depths = tuple(_depth(n, config) for n in (3, 6, 6, 3))
        backbone = CSPDarknet(widths=widths, depths=depths)
        neck = YOLOv8PAN(backbone.out_channels, depth=_depth(3, config))
        head = DFLHead(neck.out_channels, backbone.strides, num_classes=config.num_classes, reg_max=config.reg_max)
    elif isinstance(config, YOLOv3Config):
        if config.form == "tiny":
            backbone = DarknetTiny()
            neck = YOLOv3TinyFPN(backbone.out_channels)
        elif config.form in ("full", "spp"):
            backbone = Darknet53()
            neck = YOLOv3FPN(backbone.out_channels, spp=config.form == "spp")
        else:
            raise ValueError(f"unknown YOLOv3 form {config.form!r}; expected 'full', 'spp' or 'tiny'")
        head = AnchorHead(neck.out_channels, backbone.strides, config.anchors, num_classes=config.num_classes)
    else:
        raise TypeError(f"expected YOLOv8Config or YOLOv3Config, got {type(config).__name__}")
    return Detector(backbone, neck, head, config=config, name=config.name)
