"""State dicts in yolokit's naming: which variant they belong to, and checked loading.

``config_from_state_dict`` reads the class count (and ``reg_max``) from the head's last
convolutions and finds the zoo variant whose every tensor shape matches, by building
candidates on the ``meta`` device (no memory, no initialisation). ``load_checked``
compares names and shapes before loading and says what differs, naming the file.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

import torch
from torch import Tensor

from yolokit.models import MODELS, Detector, SpecConfig, YOLOv3Config, YOLOv8Config, build_model
from yolokit.models.zoo import head_facts

Config = YOLOv8Config | YOLOv3Config | SpecConfig
Shapes = dict[str, tuple[int, ...]]


def shapes_of(state: Mapping[str, Tensor]) -> Shapes:
    """``{name: shape}`` of a state dict (or of a model's ``state_dict()``)."""
    return {k: tuple(v.shape) for k, v in state.items()}


def is_fused(state: Mapping[str, Tensor]) -> bool:
    """True when the batch norms were folded into the convolutions (``Detector.fuse``)."""
    return not any(".bn." in k for k in state) and any(k.endswith(".conv.bias") for k in state)


def _with_head_facts(config: Config, shapes: Shapes) -> Config | None:
    """``config`` with the class count (and reg_max) the head tensors show, or None if they don't fit."""
    facts = head_facts(config, shapes)
    return None if facts is None else replace(config, **facts)


def expected_shapes(config: Config, *, fused: bool = False) -> Shapes:
    """Tensor shapes of ``build_model(config)`` (optionally fused), computed on the meta device."""
    with torch.device("meta"):
        model = build_model(config)
        if fused:
            model.fuse()
    return shapes_of(model.state_dict())


def shape_differences(expected: Shapes, found: Shapes, *, limit: int = 5) -> list[str]:
    """Human-readable differences between two shape maps (missing, unexpected, other shape)."""
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    wrong = [f"{k}: file {found[k]} vs model {expected[k]}" for k in expected if k in found and found[k] != expected[k]]
    out = []
    for label, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", wrong)):
        if items:
            more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
            out.append(f"{label} ({len(items)}): {', '.join(items[:limit])}{more}")
    return out


def config_from_state_dict(state: Mapping[str, Tensor], *, name: str | None = None,
                           source: str = "state dict") -> Config:
    """The zoo config (variant, class count, reg_max) whose model has exactly these tensors.

    Args:
        state: a state dict in yolokit's naming (fused or not).
        name: restrict the search to this variant.
        source: how to name the origin in errors (usually the file path).

    Raises:
        ValueError: no variant fits; the message names the closest one and what differs.

    Examples:
        >>> config_from_state_dict(create_model("yolov8s", num_classes=3).state_dict())
        YOLOv8Config(name='yolov8s', depth=0.33, width=0.5, max_channels=1024, num_classes=3, ...)
    """
    if name is not None and name not in MODELS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(MODELS)}")
    shapes, fused = shapes_of(state), is_fused(state)
    candidates = [MODELS[name]] if name else list(MODELS.values())
    best: tuple[int, str, list[str]] | None = None
    for base in candidates:
        config = _with_head_facts(base, shapes)
        if config is None:
            continue
        expected = expected_shapes(config, fused=fused)
        if expected == shapes:
            return config
        diffs = shape_differences(expected, shapes)
        score = sum(1 for k in expected if shapes.get(k) != expected[k]) + len(set(shapes) - set(expected))
        if best is None or score < best[0]:
            best = (score, base.name, diffs)
    wanted = f"{name}" if name else "any yolokit variant"
    if best is None:
        raise ValueError(f"{source}: does not look like {wanted}: no detection head tensors "
                         f"(head.cls.* / head.preds.*) among its {len(shapes)} entries")
    raise ValueError(f"{source}: tensors do not fit {wanted}; closest is {best[1]}: " + "; ".join(best[2]))


def check_state_dict(model: Detector, state: Mapping[str, Tensor], *, source: str = "state dict") -> None:
    """Raises ValueError naming ``source`` unless ``state`` has exactly the model's names and shapes."""
    expected, found = shapes_of(model.state_dict()), shapes_of(state)
    config = _with_head_facts(model.config, found) if model.config is not None else None
    if config is not None and config.num_classes != model.num_classes:
        raise ValueError(f"{source}: holds a {config.num_classes}-class head but {model.name} was built with "
                         f"{model.num_classes} classes; build it with num_classes={config.num_classes}, or pass "
                         f"the variant name (or nothing) so that the class count is read from the file")
    diffs = shape_differences(expected, found)
    if diffs:
        raise ValueError(f"{source}: tensors do not fit {model.name}{_what_it_holds(state)}: " + "; ".join(diffs))


def _what_it_holds(state: Mapping[str, Tensor]) -> str:
    try:
        config = config_from_state_dict(state)
    except ValueError:
        return ""
    return f" (the file holds a {config.name} with {config.num_classes} classes)"


def load_checked(model: Detector, state: Mapping[str, Tensor], *, source: str = "state dict") -> Detector:
    """Loads ``state`` into ``model`` after checking names and shapes; returns it in eval mode.

    A fused state dict (batch norms folded) fuses the model first. Values are cast to the
    model's dtype.
    """
    if is_fused(state) and not is_fused(model.state_dict()):
        model.fuse()
    check_state_dict(model, state, source=source)
    model.load_state_dict(dict(state), strict=True)
    return model.eval()


def build_from_state_dict(state: Mapping[str, Tensor], *, model: str | Detector | None = None,
                          source: str = "state dict") -> Detector:
    """A ready Detector holding ``state``: built from the inferred config, or ``model`` filled in.

    Args:
        state: state dict in yolokit's naming.
        model: None (infer the variant), a variant name (class count read from the
            tensors), or a Detector to load into.
        source: how to name the origin in errors.
    """
    if isinstance(model, Detector):
        return load_checked(model, state, source=source)
    if model is not None and not isinstance(model, str):
        raise TypeError(f"model must be a variant name or a Detector, got {type(model).__name__}")
    config = config_from_state_dict(state, name=model, source=source)
    return load_checked(blank_model(config, fused=is_fused(state), covered=state.keys()), state, source=source)


def blank_model(config: Config, *, fused: bool = False, covered: Iterable[str] | None = None) -> Detector:
    """``build_model(config)`` with uninitialised CPU tensors, for loading a full state dict into.

    Built on the meta device and materialised with ``to_empty``: no time spent on random
    initialisation. Falls back to a normal build when ``covered`` (the names about to be
    loaded) would leave some parameter or buffer unset.
    """
    with torch.device("meta"):
        model = build_model(config)
        if fused:
            model.fuse()
    names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    if covered is not None and not names <= set(covered):
        model = build_model(config)
        return model.fuse() if fused else model
    return model.to_empty(device="cpu")
