"""Freezing part of a model for fine-tuning: ``TrainConfig.freeze``.

``freeze=N`` freezes the first N layers of :func:`layer_names` (for YOLOv8 the first 10 are
the backbone, as Ultralytics counts its layers 0-9, so ``freeze=10`` means the same in both);
``freeze="backbone,neck.top_down4"`` freezes everything under those name prefixes.

A frozen parameter has ``requires_grad=False``: it gets no gradient, the optimizer never
sees it (so no weight decay either), and it stays bit-identical through training. Its
BatchNorm layers stay in eval mode, so their running statistics stay fixed too (the
trainer calls :func:`hold_frozen` after every ``model.train()``).
"""

from __future__ import annotations

from torch import nn

from yolokit.models import LayerGraph

_CONTAINERS = (nn.ModuleList, nn.Sequential)


def under(name: str, prefixes: list[str] | tuple[str, ...]) -> bool:
    """Whether the parameter, buffer or module ``name`` is one of ``prefixes`` or lies under one."""
    return any(name == pre or name.startswith(pre + ".") for pre in prefixes)


def layer_names(model: nn.Module) -> list[str]:
    """The model's layers in forward order, as ``freeze=N`` counts them.

    Children of ``backbone``, ``neck`` and ``head`` that hold parameters; a backbone or
    neck container (``ModuleList``, ``Sequential``: the stages) counts its children instead.
    A model built from a model YAML counts the file's rows, as Ultralytics does: ``backbone.<i>``
    and ``neck.<i>`` for every row (rows without parameters too), then ``head``, so ``freeze=N``
    freezes rows 0 to N-1 of the file.

    Examples:
        >>> layer_names(yolokit.create_model("yolov8n"))[:3]
        ['backbone.stem', 'backbone.stages.0.0', 'backbone.stages.0.1']
        >>> layer_names(yolokit.create_model("yolo11n.yaml"))[9:12]
        ['backbone.9', 'backbone.10', 'neck.11']
    """
    if isinstance(model.backbone, LayerGraph) and isinstance(model.neck, LayerGraph):
        return [f"backbone.{i}" for i in model.backbone.rows] + [f"neck.{i}" for i in model.neck.rows] + ["head"]
    names: list[str] = []

    def walk(prefix: str, module: nn.Module, expand: bool) -> None:
        for name, child in module.named_children():
            full = f"{prefix}.{name}"
            if expand and isinstance(child, _CONTAINERS):
                walk(full, child, expand)
            elif any(True for _ in child.parameters()):
                names.append(full)

    for part in ("backbone", "neck", "head"):
        walk(part, getattr(model, part), expand=part != "head")
    return names


def freeze_prefixes(model: nn.Module, spec: int | str | list[str] | None) -> list[str]:
    """The module prefixes ``spec`` freezes: the first N of :func:`layer_names`, or the names given.

    Raises:
        ValueError: N beyond the model's layers, or a name that matches no parameter (both
            named in the message).
    """
    if spec is None or spec == 0 or spec == "" or spec == []:
        return []
    layers = layer_names(model)
    if isinstance(spec, int):
        if not 0 < spec <= len(layers):
            raise ValueError(f"freeze={spec}: the model has {len(layers)} layers (freeze counts them from "
                             f"{layers[0]} to {layers[-1]})")
        return layers[:spec]
    names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec) if n.strip()]
    params = [n for n, _ in model.named_parameters()]
    unknown = [n for n in names if not any(under(p, [n]) for p in params)]
    if unknown:
        raise ValueError(f"freeze names no parameters of the model: {', '.join(unknown)} (layers are "
                         f"{', '.join(layers[:4])}, ...; any prefix of a parameter name works)")
    return names


def freeze(model: nn.Module, prefixes: list[str]) -> int:
    """Sets ``requires_grad=False`` under ``prefixes`` and holds their BatchNorms; returns the parameters frozen."""
    frozen = 0
    for name, p in model.named_parameters():
        if under(name, prefixes):
            p.requires_grad_(False)
            frozen += p.numel()
    hold_frozen(model, prefixes)
    return frozen


def hold_frozen(model: nn.Module, prefixes: list[str]) -> None:
    """Puts the BatchNorm layers under ``prefixes`` in eval mode (their running statistics stay fixed)."""
    if not prefixes:
        return
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and under(name, prefixes):
            m.eval()
