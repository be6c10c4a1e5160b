"""Variants as data, the table of families, and the builders ``create_model`` / ``list_models``.

A YOLOv8 size is three numbers (depth, width, max channels); a YOLOv3 variant is its
form and anchors; a model YAML's config (``SpecConfig``) is the file's content, scale and
class count. ``build_model(config)`` turns any config into a ``Detector`` and
``config_from_dict(asdict(config))`` gives the config back, as checkpoints store it.
``FAMILIES`` holds what differs between YOLOv8 and YOLOv3 (config class, builder, how the
head tensors show the class count); nothing else
switches on the family.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from torch import nn

from yolokit.models.backbones import CSPDarknet, Darknet53, DarknetTiny
from yolokit.models.detector import Detector
from yolokit.models.heads import AnchorHead, DFLHead
from yolokit.models.necks import YOLOv3FPN, YOLOv3TinyFPN, YOLOv8PAN
from yolokit.models.spec import Modules, build_spec_model, create_from_yaml, spec_head_facts
from yolokit.models.spec_config import CFG, SPEC_FAMILY, SpecConfig, find_yaml

Anchors = tuple[tuple[tuple[int, int], ...], ...]
Shapes = dict[str, tuple[int, ...]]

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
"""The built-in variants by name (`list_models()`), each a config: `build_model(MODELS["yolov8s"])`."""


SEGMENT_MODELS: tuple[str, ...] = tuple(f"{family}{scale}-seg" for family in ("yolov8", "yolo11", "yolo26")
                                        for scale in "nsmlx")
"""The built-in instance segmentation names (``create_model("yolov8n-seg")``): the packaged
``yolov8-seg.yaml``, ``yolo11-seg.yaml`` and ``yolo26-seg.yaml`` at each scale."""


def list_models(task: str = "detect") -> list[str]:
    """Built-in names accepted by ``create_model``: the detection variants, or (``task="segment"``) the
    instance segmentation ones. Model YAMLs are accepted too (``models.spec.packaged_yamls``)."""
    if task not in ("detect", "segment"):
        raise ValueError(f"task must be 'detect' or 'segment', got {task!r}")
    return list(MODELS) if task == "detect" else list(SEGMENT_MODELS)


def packaged_model(name: Any) -> str | None:
    """The packaged model YAML a plain name means, as the reference's names do: ``yolo26n`` is ``yolo26n.yaml``
    (``yolo26.yaml`` at scale n), ``yolo11s-seg`` is ``yolo11-seg.yaml`` at scale s; None for a name no packaged
    YAML has (a built-in variant's, ``yolov8n``, is built from its config: ``MODELS``)."""
    if not isinstance(name, str) or not name or name in MODELS or Path(name).suffix or "/" in name or "\\" in name:
        return None
    try:
        find_yaml(CFG / f"{name}.yaml")
    except FileNotFoundError:
        return None
    return f"{name}.yaml"


def is_yaml_name(name: Any) -> bool:
    """Whether ``create_model`` reads ``name`` as a model YAML (a path or name ending in .yaml / .yml)."""
    return isinstance(name, (str, Path)) and Path(name).suffix in (".yaml", ".yml")


def create_model(name: str | Path | Mapping[str, Any], *, num_classes: int | None = None, scale: str | None = None,
                 modules: Modules | None = None) -> Detector:
    """A freshly initialised model: a built-in variant, or a model YAML.

    Args:
        name: a built-in name (``list_models()``, ``list_models("segment")``), a model YAML's path, a
            packaged YAML's name with or without a scale letter (``yolo11s.yaml`` is ``yolo11.yaml`` at scale s,
            ``yolov8n-p2.yaml`` is ``yolov8-p2.yaml`` at scale n), or a YAML's content as a dict.
        num_classes: classes C (default: the file's ``nc``, else 80).
        scale: a letter of the YAML's ``scales`` (default: the one in the name, else the file's).
        modules: blocks of the user's for this build, by the name the YAML's rows use
            (``models.register_module`` makes them known to every build, and to loading files).

    Examples:
        >>> model = create_model("yolov8n", num_classes=3)
        >>> [m.shape for m in model(torch.zeros(1, 3, 64, 64))]
        [torch.Size([1, 67, 8, 8]), torch.Size([1, 67, 4, 4]), torch.Size([1, 67, 2, 2])]
        >>> create_model("yolov8n-p2.yaml", num_classes=3).strides
        (4, 8, 16, 32)
    """
    if isinstance(name, Mapping) or is_yaml_name(name):
        return create_from_yaml(name, scale=scale, num_classes=num_classes, modules=modules)
    packaged = packaged_model(name)
    if packaged is not None:                       # yolo26n, yolo11s-seg: a packaged YAML at a scale
        return create_from_yaml(packaged, scale=scale, num_classes=num_classes, modules=modules)
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(MODELS)}, the segmentation models "
                         f"(yolov8n-seg ... yolo26x-seg), a packaged model YAML's name at a scale (yolo11n, "
                         f"yolo26s, yolov8s-p2), or a model YAML (a path)")
    if scale is not None or modules is not None:
        raise ValueError(f"{name} is a built-in variant: scale and modules apply to model YAMLs only")
    num_classes = 80 if num_classes is None else num_classes
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    return build_model(replace(MODELS[name], num_classes=num_classes))


def config_from_dict(data: dict[str, Any]) -> YOLOv8Config | YOLOv3Config | SpecConfig:
    """Inverse of ``dataclasses.asdict`` for model configs (lists become tuples)."""
    family = data.get("family")
    if family == SPEC_FAMILY:
        return _spec_config_from_dict(data)
    if family not in FAMILIES:
        raise ValueError(f"model config has unknown family {family!r}")
    cls = FAMILIES[family].config
    known = {f.name for f in fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"unknown {family} config fields: {sorted(unknown)}")
    values = dict(data)
    if "anchors" in values:
        values["anchors"] = tuple(tuple(tuple(int(v) for v in a) for a in level) for level in values["anchors"])
    return cls(**values)


def _spec_config_from_dict(data: dict[str, Any]) -> SpecConfig:
    unknown = set(data) - {f.name for f in fields(SpecConfig)}
    if unknown:
        raise ValueError(f"unknown {SPEC_FAMILY} config fields: {sorted(unknown)}")
    if not isinstance(data.get("spec"), Mapping) or not isinstance(data.get("name"), str):
        raise ValueError("a model YAML's config needs its 'name' and the file's content under 'spec'")
    return SpecConfig(**{**data, "spec": dict(data["spec"])})


def head_facts(config: Any, shapes: Shapes) -> dict[str, int] | None:
    """The config fields a state dict's head tensors show (class count, ``reg_max``), or None when they
    do not fit: the family's ``head_facts``, or the model YAML's."""
    if isinstance(config, SpecConfig):
        return spec_head_facts(config, shapes)
    return family_of(config).head_facts(config, shapes)


def _channels(c: int, cfg: YOLOv8Config) -> int:
    return math.ceil(min(c, cfg.max_channels) * cfg.width / 8) * 8


def _depth(n: int, cfg: YOLOv8Config) -> int:
    return max(round(n * cfg.depth), 1)


def _build_v8(config: YOLOv8Config) -> tuple[nn.Module, nn.Module, nn.Module]:
    widths = tuple(_channels(c, config) for c in (64, 128, 256, 512, 1024))
    depths = tuple(_depth(n, config) for n in (3, 6, 6, 3))
    backbone = CSPDarknet(widths=widths, depths=depths)
    neck = YOLOv8PAN(backbone.out_channels, depth=_depth(3, config))
    head = DFLHead(neck.out_channels, backbone.strides, num_classes=config.num_classes, reg_max=config.reg_max)
    return backbone, neck, head


def _build_v3(config: YOLOv3Config) -> tuple[nn.Module, nn.Module, nn.Module]:
    if config.form == "tiny":
        backbone = DarknetTiny()
        neck = YOLOv3TinyFPN(backbone.out_channels)
    elif config.form in ("full", "spp"):
        backbone = Darknet53()
        neck = YOLOv3FPN(backbone.out_channels, spp=config.form == "spp")
    else:
        raise ValueError(f"unknown YOLOv3 form {config.form!r}; expected 'full', 'spp' or 'tiny'")
    head = AnchorHead(neck.out_channels, backbone.strides, config.anchors, num_classes=config.num_classes)
    return backbone, neck, head


def _v8_head_facts(shapes: Shapes) -> dict[str, int] | None:
    cls, box = shapes.get("head.cls.0.2.weight"), shapes.get("head.box.0.2.weight")
    if cls is None or box is None or box[0] % 4:
        return None
    return {"num_classes": cls[0], "reg_max": box[0] // 4}


def _v3_head_facts(shapes: Shapes, anchors: int) -> dict[str, int] | None:
    pred = shapes.get("head.preds.0.weight")
    if pred is None or pred[0] % anchors or pred[0] // anchors <= 5:
        return None
    return {"num_classes": pred[0] // anchors - 5}


@dataclass(frozen=True)
class Family:
    """What depends on a model family, in one place; code elsewhere reads it instead of switching.

    Attributes:
        name: The ``family`` field of its configs.
        config: The config class.
        parts: ``parts(config)`` -> (backbone, neck, head) modules.
        head_facts: ``head_facts(config, shapes)`` -> the config fields a state dict's head
            tensors show (class count, ``reg_max``), or None when the tensors do not fit.

    The loss a model trains with follows its head's type (``yolokit.train.build.build_loss``).
    """

    name: str
    config: type
    parts: Callable[[Any], tuple[nn.Module, nn.Module, nn.Module]]
    head_facts: Callable[[Any, Shapes], dict[str, int] | None]


FAMILIES: dict[str, Family] = {
    "yolov8": Family("yolov8", YOLOv8Config, _build_v8, lambda config, shapes: _v8_head_facts(shapes)),
    "yolov3": Family("yolov3", YOLOv3Config, _build_v3,
                     lambda config, shapes: _v3_head_facts(shapes, len(config.anchors[0]))),
}


def family_of(config: Any) -> Family:
    """The family of a model config (or of its ``family`` name).

    Examples:
        >>> family_of(MODELS["yolov3-tiny"]).config.__name__
        'YOLOv3Config'
    """
    name = config if isinstance(config, str) else getattr(config, "family", None)
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}")
    family = FAMILIES[name]
    if not isinstance(config, str) and not isinstance(config, family.config):
        raise TypeError(f"expected a {family.config.__name__} for family {name!r}, got {type(config).__name__}")
    return family


def build_model(config: YOLOv8Config | YOLOv3Config | SpecConfig) -> Detector:
    """A ``Detector`` built from a config, freshly initialised.

    A model YAML's config rebuilds from the file content it holds: blocks of the user's it names
    must be registered (``register_module``), and weights files its rows name (a timm backbone's)
    are not read: the checkpoint that stored the config supplies the weights. ``create_model``
    reads them.
    """
    if isinstance(config, SpecConfig):
        return build_spec_model(config, weights=False)
    if not hasattr(config, "family"):
        raise TypeError(f"expected a model config ({', '.join(f.config.__name__ for f in FAMILIES.values())}), "
                        f"got {type(config).__name__}")
    backbone, neck, head = family_of(config).parts(config)
    return Detector(backbone, neck, head, config=config, name=config.name)
