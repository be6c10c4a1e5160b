"""Ultralytics detection checkpoints (YOLOv8, YOLO11, P2/P6, YOLOv5u, ...) and instance segmentation
ones (-seg: built from the model file they carry), read without ultralytics and without running code.

Their trainer writes a dict whose ``"model"`` (finished run, usually float16) or ``"ema"``
(during training) holds a pickled ``DetectionModel``. ``read_ultralytics`` unpickles it
through ``load_pickled`` (each of their classes becomes an inert stand-in) and keeps the
tensors and the model's ``yaml`` attribute: its model file's content, plain data. A plain
state dict in their naming is accepted too.

A YOLOv8 maps onto yolokit's built-in YOLOv8 by layer index (``LAYER_NAMES``), as it always
has. Any other architecture is built from the model file it carries (``models.spec``), whose
layers are named by row (``backbone.<i>``, ``neck.<i>``), so ``model.<i>.<...>`` becomes
``backbone.<i>.<...>`` or ``neck.<i>.<...>`` and the Detect layer's ``cv2`` / ``cv3`` / ``dfl``
become ``head.box`` / ``head.cls`` / ``head.dfl``. Inside each layer both use the same names
(``conv``, ``bn``, ``cv1``, ``cv2``, ``m``, ``attn``, ...).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from torch import Tensor

from yolokit.interop.native import attach_names, is_safetensors_file, read_safetensors
from yolokit.interop.safe_load import StandIn, load_pickled, module_state_dict
from yolokit.interop.state import blank_model, build_from_state_dict, is_fused, load_checked, shapes_of
from yolokit.models import Detector, LayerGraph, SpecConfig
from yolokit.models.spec import spec_head_facts
from yolokit.models.spec_config import SpecError, spec_config

# Ultralytics yolov8.yaml layer index -> yolokit module. 10, 13 (Upsample) and 11, 14, 17,
# 20 (Concat) hold no tensors.
LAYER_NAMES: dict[int, str] = {
    0: "backbone.stem",
    1: "backbone.stages.0.0",  # stride-2 Conv
    2: "backbone.stages.0.1",  # C2f
    3: "backbone.stages.1.0",
    4: "backbone.stages.1.1",
    5: "backbone.stages.2.0",
    6: "backbone.stages.2.1",
    7: "backbone.stages.3.0",
    8: "backbone.stages.3.1",
    9: "backbone.stages.3.2",  # SPPF
    12: "neck.top_down4",  # C2f after upsample(P5) + P4
    15: "neck.top_down3",  # C2f after upsample + P3 -> output stride 8
    16: "neck.down3",  # stride-2 Conv
    18: "neck.bottom_up4",  # C2f -> output stride 16
    19: "neck.down4",
    21: "neck.bottom_up5",  # C2f -> output stride 32
}
# The Detect layer (index 22): per-level box and class branches, and the DFL projection.
HEAD_INDEX = 22
HEAD_NAMES: dict[str, str] = {"cv2": "head.box", "cv3": "head.cls", "dfl": "head.dfl"}
# A model file's Detect row may also have the one-to-one branch (end2end: YOLO26).
SPEC_HEAD_NAMES: dict[str, str] = {**HEAD_NAMES, "one2one_cv2": "head.one2one_box", "one2one_cv3": "head.one2one_cls",
                                   # a Segment / Segment26 row's coefficient branches and prototype network
                                   "cv4": "head.coef", "one2one_cv4": "head.one2one_coef", "proto": "head.proto"}
# Inside YOLO26-seg's prototype network (models.segment.FusedProto), the parts whose names differ.
PROTO_NAMES: dict[str, str] = {"feat_refine": "refine", "feat_fuse": "fuse_conv", "semseg": "semantic"}

_KEY = re.compile(r"^model\.(\d+)\.(.+)$")


def yolokit_name(key: str) -> str:
    """yolokit's name for one Ultralytics state-dict key.

    Examples:
        >>> yolokit_name("model.2.m.0.cv1.conv.weight"), yolokit_name("model.22.cv3.1.2.bias")
        ('backbone.stages.0.1.m.0.cv1.conv.weight', 'head.cls.1.2.bias')

    Raises:
        KeyError: the key belongs to no layer of a YOLOv8 detection model.
    """
    match = _KEY.match(key)
    if match is None:
        raise KeyError(key)
    index, rest = int(match.group(1)), match.group(2)
    if index == HEAD_INDEX:
        branch, _, tail = rest.partition(".")
        if branch not in HEAD_NAMES or not tail:
            raise KeyError(key)
        return f"{HEAD_NAMES[branch]}.{tail}"
    if index not in LAYER_NAMES:
        raise KeyError(key)
    return f"{LAYER_NAMES[index]}.{rest}"


def is_ultralytics_state_dict(state: Mapping[str, Any]) -> bool:
    """True when every key looks like ``model.<index>.<...>`` (Ultralytics' naming)."""
    return bool(state) and all(isinstance(k, str) and _KEY.match(k) for k in state)


def ultralytics_to_yolokit(state: Mapping[str, Tensor], *, source: str = "state dict") -> dict[str, Tensor]:
    """Renames an Ultralytics YOLOv8 state dict to yolokit's names (values untouched).

    Raises:
        ValueError: some keys belong to no YOLOv8 detection layer (another task or
            architecture); the message lists them.
    """
    out, unknown = {}, []
    for key, value in state.items():
        try:
            out[yolokit_name(key)] = value
        except KeyError:
            unknown.append(key)
    if unknown:
        more = f" (+{len(unknown) - 5} more)" if len(unknown) > 5 else ""
        raise ValueError(f"{source}: not a YOLOv8 detection model: no yolokit layer for "
                         f"{', '.join(unknown[:5])}{more}")
    return out


@dataclass(frozen=True)
class UltralyticsCheckpoint:
    """The tensors of an Ultralytics checkpoint and what else is worth keeping.

    Attributes:
        state_dict: tensors in Ultralytics' naming, dtype as stored (often float16).
        class_names: ``{index: name}`` when the file has them.
        entry: where the model was found: "ema", "model" or "state_dict" (a plain dict).
        version: the ultralytics version that wrote it, when recorded.
        architecture: the model's model file content (its ``yaml`` attribute), when pickled with it.
    """

    state_dict: dict[str, Tensor]
    class_names: dict[int, str] = field(default_factory=dict)
    entry: str = "state_dict"
    version: str | None = None
    architecture: dict[str, Any] | None = None


def ultralytics_contents(obj: Any) -> UltralyticsCheckpoint | None:
    """The checkpoint inside an unpickled object, or None when it is not an Ultralytics one.

    Accepts their trainer's dict (model object under "ema" or "model"; "ema" wins when
    set, as their loader does), that dict holding a state dict instead, or a plain state
    dict in their naming.
    """
    if not isinstance(obj, Mapping):
        return None
    if is_ultralytics_state_dict(obj):
        return UltralyticsCheckpoint(_tensors(obj))
    for entry in ("ema", "model"):
        value = obj.get(entry)
        if isinstance(value, StandIn):
            version = obj.get("version") if isinstance(obj.get("version"), str) else None
            return UltralyticsCheckpoint(module_state_dict(value), _class_names(value), entry, version,
                                         _architecture(value))
        if isinstance(value, Mapping) and is_ultralytics_state_dict(value):
            return UltralyticsCheckpoint(_tensors(value), entry=entry)
    return None


def _architecture(model: StandIn) -> dict[str, Any] | None:
    arch = getattr(model, "yaml", None)
    return dict(arch) if isinstance(arch, Mapping) and "backbone" in arch and "head" in arch else None


def _class_names(model: StandIn) -> dict[int, str]:
    names = getattr(model, "names", None)
    if isinstance(names, (list, tuple)):
        names = dict(enumerate(names))
    if not isinstance(names, Mapping):
        return {}
    return {int(k): str(v) for k, v in names.items() if isinstance(k, int) or str(k).isdigit()}


def _tensors(state: Mapping[str, Any]) -> dict[str, Tensor]:
    return {k: v.detach() if isinstance(v, Tensor) else v for k, v in state.items()}


def read_ultralytics(path: str | Path) -> UltralyticsCheckpoint:
    """Reads an Ultralytics checkpoint (``.pt``) without ultralytics and without running code.

    A safetensors file holding a state dict in their naming is read too.

    Raises:
        UnsafeFileError: the pickle refers to anything beyond tensors, containers and
            their detection model classes.
        ValueError: the file holds no Ultralytics detection model.
    """
    if is_safetensors_file(path):
        contents = ultralytics_contents(read_safetensors(path)[0])
    else:
        contents = ultralytics_contents(load_pickled(path))
    if contents is None:
        raise ValueError(f"{path}: not an Ultralytics checkpoint (no model under 'ema' or 'model', "
                         "and not a state dict in their naming)")
    return contents


def load_ultralytics(path: str | Path, *, model: str | Detector | None = None) -> Detector:
    """A ready yolokit Detector (eval mode, float32) from an Ultralytics detection checkpoint.

    Args:
        path: their ``.pt`` file (finished run or training checkpoint, float16 or float32),
            or a ``torch.save``-d state dict in their naming.
        model: None to infer the model (a YOLOv8 variant from the tensor shapes, any other
            architecture from the model file the checkpoint carries), a variant name to insist
            on one, or a Detector to load into (a model YAML's takes any architecture's state dict).

    Examples:
        >>> model = load_ultralytics("yolov8n.pt")
        >>> model.name, model.num_classes, model.names[0]
        ('yolov8n', 80, 'person')
        >>> load_ultralytics("yolo11n.pt").config.scale
        'n'
    """
    return detector_from_checkpoint(read_ultralytics(path), model=model, source=str(path))


def detector_from_checkpoint(contents: UltralyticsCheckpoint, *, model: str | Detector | None,
                             source: str) -> Detector:
    """The Detector an Ultralytics checkpoint holds: a YOLOv8 as yolokit's built-in variant (as always),
    any other architecture built from the model file it carries, or ``model`` filled in."""
    if isinstance(model, Detector) and is_spec_model(model):
        state = to_spec_names(contents.state_dict, model=model, source=source)
        return attach_names(load_checked(model, state, source=source), contents.class_names)
    try:
        state = ultralytics_to_yolokit(contents.state_dict, source=source)
        detector = build_from_state_dict(state, model=model, source=source)
    except ValueError:
        if contents.architecture is None or model is not None:
            raise
        detector = from_architecture(contents.architecture, contents.state_dict, source=source)
    return attach_names(detector, contents.class_names)


def is_spec_model(model: Detector) -> bool:
    """Whether ``model`` was built from a model YAML (its layers named by row)."""
    return isinstance(model.backbone, LayerGraph) and isinstance(model.neck, LayerGraph)


def from_architecture(architecture: Mapping[str, Any], state: Mapping[str, Tensor], *, source: str) -> Detector:
    """A Detector built from a checkpoint's model file content, holding its tensors (class count from them).

    Raises:
        ValueError: the architecture cannot be built (the message names the layer), or the
            tensors do not fit it.
    """
    try:
        config = spec_config(architecture)
    except (SpecError, TypeError) as exc:
        raise ValueError(f"{source}: the model file it carries is not usable ({exc})") from exc
    n_backbone, head = _layout(config)
    renamed = to_spec_names(state, n_backbone=n_backbone, head=head, source=source)
    facts = spec_head_facts(config, shapes_of(renamed))
    if facts is not None:
        config = replace(config, **facts)
    try:
        model = blank_model(config, fused=is_fused(renamed), covered=renamed.keys())
    except SpecError as exc:
        raise ValueError(f"{source}: {exc}") from exc
    return load_checked(model, renamed, source=source)


def _layout(config: SpecConfig) -> tuple[int, int]:
    """(rows in the backbone, index of the head row) of a model file."""
    backbone, head = config.spec.get("backbone"), config.spec.get("head")
    if not isinstance(backbone, list) or not isinstance(head, list) or not head:
        raise ValueError(f"model file of {config.name}: needs 'backbone' and 'head' lists")
    return len(backbone), len(backbone) + len(head) - 1


def to_spec_names(state: Mapping[str, Tensor], *, model: Detector | None = None, n_backbone: int | None = None,
                  head: int | None = None, source: str = "state dict") -> dict[str, Tensor]:
    """Renames a state dict in Ultralytics' naming for a model built from a model YAML.

    ``model.<i>.<...>`` -> ``backbone.<i>.<...>`` (backbone rows), ``neck.<i>.<...>`` (rows
    before the head), ``head.box|cls|dfl.<...>`` (the head row's ``cv2|cv3|dfl``) and
    ``head.one2one_box|one2one_cls.<...>`` (an end-to-end head's ``one2one_cv2|one2one_cv3``), and a
    segmentation head's ``cv4`` / ``one2one_cv4`` / ``proto`` as ``head.coef`` / ``head.one2one_coef`` /
    ``head.proto`` (``PROTO_NAMES`` inside YOLO26-seg's prototypes). The layout
    comes from ``model`` or from ``n_backbone`` and ``head`` (the head row's index).

    Examples:
        >>> to_spec_names({"model.23.cv3.0.2.bias": b}, n_backbone=11, head=23)
        {'head.cls.0.2.bias': b}

    Raises:
        ValueError: keys of no row of that layout (the message lists some).
    """
    if model is not None:
        n_backbone, head = len(model.backbone.rows), len(model.backbone.rows) + len(model.neck.rows)
    out, unknown = {}, []
    for key, value in state.items():
        match = _KEY.match(key)
        index, rest = (int(match.group(1)), match.group(2)) if match else (-1, "")
        if index == head:
            branch, _, tail = rest.partition(".")
            if branch == "proto":
                part, dot, inner = tail.partition(".")
                tail = f"{PROTO_NAMES.get(part, part)}{dot}{inner}"
            name = f"{SPEC_HEAD_NAMES[branch]}.{tail}" if branch in SPEC_HEAD_NAMES and tail else None
        else:
            name = (f"backbone.{index}.{rest}" if 0 <= index < n_backbone
                    else f"neck.{index}.{rest}" if n_backbone <= index < head else None)
        if name is None:
            unknown.append(key)
        else:
            out[name] = value
    if unknown:
        more = f" (+{len(unknown) - 5} more)" if len(unknown) > 5 else ""
        raise ValueError(f"{source}: keys of no layer of a {head + 1}-row model: {', '.join(unknown[:5])}{more}")
    return out


def yolokit_state(state: Mapping[str, Tensor], *, model: str | Detector | None, source: str) -> dict[str, Tensor]:
    """A state dict in Ultralytics' naming renamed for ``model``: a model YAML's layout when ``model``
    is such a Detector, else yolokit's built-in YOLOv8."""
    if isinstance(model, Detector) and is_spec_model(model):
        return to_spec_names(state, model=model, source=source)
    return ultralytics_to_yolokit(state, source=source)
