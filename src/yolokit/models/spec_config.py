"""What a model YAML name means: the file it names, its content as plain data, its scale and class count.

``spec_config`` turns a path, a packaged name (``yolo11s.yaml`` is ``yolo11.yaml`` at scale s) or a
YAML's content into a ``SpecConfig``; ``models.spec`` builds the Detector from it.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

SPEC_FAMILY = "spec"
CFG = Path(__file__).resolve().parent / "cfg"   # yolokit's own model files (package data)
_SCALE_IN_NAME = re.compile(r"yolo(?:e-)?v?\d+([nslmx])")   # the letter after the version: yolo11s, yolov8n-p2


class SpecError(ValueError):
    """A model file that cannot be built; the message names the file, the layer index and the module."""


@dataclass(frozen=True)
class SpecConfig:
    """A model built from a model YAML.

    Attributes:
        name: the model's name ("yolo11s", "yolov8n-p2", "my-net-s").
        spec: the YAML's content as plain data (dicts, lists, strings, numbers, booleans, None).
        scale: the letter of ``spec["scales"]`` used; None for files without scales.
        num_classes: number of classes C.
        family: always "spec" (how ``config_from_dict`` tells it from the built-in configs).
    """

    name: str
    spec: dict[str, Any] = field(repr=False)
    scale: str | None = None
    num_classes: int = 80
    family: str = SPEC_FAMILY


def packaged_yamls() -> list[str]:
    """File names of the model YAMLs yolokit ships (``create_model`` finds them by name)."""
    return sorted(p.name for p in CFG.glob("*.yaml"))


def plain(value: Any, where: str = "spec") -> Any:
    """``value`` as plain data (tuples become lists); anything else is a SpecError naming where it sits."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise SpecError(f"{where}: keys must be strings, got {[k for k in value if not isinstance(k, str)]}")
        return {k: plain(v, f"{where}.{k}") for k, v in value.items()}
    raise SpecError(f"{where}: {type(value).__name__} is not plain data (YAML values only)")


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A model file's content (``yaml.safe_load``: nothing in it is evaluated)."""
    path = Path(path)
    try:
        content = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML ({exc})") from exc
    if not isinstance(content, dict):
        raise SpecError(f"{path}: a model file holds a mapping with 'backbone' and 'head' rows")
    return plain(content, str(path))


def find_yaml(name: str | Path) -> Path:
    """The file a model YAML name means: the path itself, else yolokit's packaged file of that name,
    else the same without the scale letter (``yolo11s.yaml`` -> ``yolo11.yaml``, ``yolov8n-p2.yaml`` ->
    ``yolov8-p2.yaml``), next to the path or packaged. YOLOv5's "u" (its anchor-free form, the only
    one yolokit ships) may follow the letter: ``yolov5nu.yaml`` is ``yolov5.yaml`` at scale n."""
    path = Path(name)
    stem = re.sub(r"^(yolov5[nslmx]?)u$", r"\1", path.stem)
    unified = path.with_name(re.sub(r"(\d+)([nslmx])(.+)?$", r"\1\3", stem) + path.suffix)
    for candidate in (path, CFG / path.name, unified, CFG / unified.name):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{name}: no such model file (nor a packaged one; yolokit ships "
                            f"{', '.join(packaged_yamls())}, each at every scale of its 'scales', e.g. yolo11s.yaml)")


def spec_config(source: str | Path | Mapping[str, Any], *, scale: str | None = None,
                num_classes: int | None = None, name: str | None = None) -> SpecConfig:
    """The config of a model YAML (a path, a packaged name such as ``yolo11s.yaml``, or its content).

    The scale is ``scale``, else the letter in the file name (``yolo11s.yaml``), else the file's own
    ``scale``, else the first of its ``scales`` (with a warning). The class count is ``num_classes``,
    else the file's ``nc``, else 80.
    """
    if isinstance(source, Mapping):
        spec, origin = plain(dict(source)), "model spec"
        stem = Path(str(spec.get("yaml_file") or "model")).stem
    else:
        path = find_yaml(source)
        spec, origin, stem = read_yaml(path), str(path), Path(source).stem
    guessed = _SCALE_IN_NAME.search(stem)
    scales = spec.get("scales")
    if scales is not None and not (isinstance(scales, dict) and scales):
        raise SpecError(f"{origin}: 'scales' must map a letter to [depth, width, max_channels]")
    if scales:
        named = guessed.group(1) if guessed and guessed.group(1) in scales else None
        own = spec.get("scale") if isinstance(spec.get("scale"), str) and spec["scale"] in scales else None
        chosen = scale or named or own
        if chosen is None:
            chosen = next(iter(scales))
            warnings.warn(f"{origin}: no scale given; using '{chosen}', the first of {list(scales)}", stacklevel=2)
        if chosen not in scales:
            raise SpecError(f"{origin}: unknown scale {chosen!r}; the file has {list(scales)}")
    elif scale is not None:
        raise SpecError(f"{origin}: has no 'scales', so scale={scale!r} cannot be applied")
    else:
        chosen = None
    classes = num_classes if num_classes is not None else spec.get("nc", 80)
    if isinstance(classes, bool) or not isinstance(classes, int) or classes < 1:
        raise SpecError(f"{origin}: the class count must be an integer >= 1, got {classes!r}")
    if name is None and guessed and guessed.group(1) == chosen:
        name = stem
    elif name is None:   # the letter in the name, if any, replaced by the scale used
        base = stem[:guessed.start(1)] + stem[guessed.end(1):] if guessed else stem
        name = _scaled_name(base, chosen)
    return SpecConfig(name, spec, chosen, classes)


def _scaled_name(stem: str, scale: str | None) -> str:
    """``yolo11`` + s -> ``yolo11s``; ``yolov8-p2`` + n -> ``yolov8n-p2``; ``my-net`` + s -> ``my-net-s``."""
    if scale is None:
        return stem
    match = re.match(r"^(yolo\D*?\d+)(.*)$", stem)
    return f"{match.group(1)}{scale}{match.group(2)}" if match else f"{stem}-{scale}"
