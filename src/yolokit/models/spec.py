"""Model YAMLs in the community format -> ``Detector``.

A file holds ``backbone`` and ``head`` lists of rows ``[from, repeats, module, args]``: ``from`` is
the row (or rows) whose output the layer reads (-1: the previous row; the first row's -1 is the
images), ``repeats`` is scaled by the model's depth, ``module`` is a name of ``models.spec_table``
(or one the user registered) and ``args`` its arguments. ``scales`` maps a letter to
``[depth, width, max_channels]``; files without it may give ``depth_multiple`` / ``width_multiple``.
The last row is the head: ``Detect`` (``[nc]``; a ``DFLHead`` over the maps it reads, ``reg_max``
from the file, 16 by default; an ``EndToEndHead`` when the file says ``end2end: true``),
``AnchorDetect`` (``[nc, anchors]``; an ``AnchorHead``), or an instance segmentation head
(``models.segment``): ``Segment`` (``[nc, masks, prototype channels]``, 32 and 256 by default, the
channels scaled by width as a row's are; a ``SegmentHead``) or ``Segment26`` (the same arguments, with
``end2end: true``; an ``EndToEndSegmentHead``).

The rows before the head become two ``LayerGraph`` modules, the ``backbone`` (the file's backbone
rows) and the ``neck`` (the head rows but the last), whose children are named by row index, so
``model.<i>.<...>`` state dicts of the community format map onto ``backbone.<i>`` / ``neck.<i>``.
Each new layer is run once on an empty batch (no arithmetic) of maps of a 256 x 256 input: that
gives its output channels, and the strides the head's levels have.

The model's config is a ``SpecConfig``: the file's content as plain data, the scale and the class
count. ``asdict`` of it is what checkpoints store; ``build_model`` rebuilds the model from it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from yolokit.models.detector import Detector
from yolokit.models.graph import LayerGraph
from yolokit.models.heads import AnchorHead, DFLHead, EndToEndHead
from yolokit.models.segment import EndToEndSegmentHead, SegmentHead, proto_channels
from yolokit.models.spec_config import SpecConfig, SpecError, spec_config
from yolokit.models.spec_table import HEADS, ModuleRule, module_rule

DRY_SIZE = 256   # side of the (empty-batch) input the layers are run on while building
Modules = Mapping[str, Callable[..., nn.Module] | ModuleRule]


@dataclass(frozen=True)
class Row:
    """One parsed row: absolute sources (-1: the images), raw repeats, module name, args as written."""

    index: int
    sources: int | tuple[int, ...]
    repeats: int
    module: str
    args: list[Any]
    where: str


def create_from_yaml(source: str | Path | Mapping[str, Any], *, scale: str | None = None,
                     num_classes: int | None = None, modules: Modules | None = None,
                     name: str | None = None) -> Detector:
    """A freshly initialised Detector from a model YAML (see ``spec_config`` and ``build_spec_model``)."""
    config = spec_config(source, scale=scale, num_classes=num_classes, name=name)
    origin = str(source) if not isinstance(source, Mapping) else config.name
    return build_spec_model(config, modules=modules, source=origin)


def parse_rows(spec: Mapping[str, Any], source: str) -> tuple[list[Row], int]:
    """The rows of ``backbone`` then ``head`` (absolute sources), and how many belong to the backbone."""
    backbone, head = spec.get("backbone"), spec.get("head")
    for key, rows in (("backbone", backbone), ("head", head)):
        if not isinstance(rows, list) or not rows:
            raise SpecError(f"{source}: needs a non-empty '{key}' list of [from, repeats, module, args] rows")
    parsed = []
    for i, row in enumerate(backbone + head):
        module = row[2] if isinstance(row, list) and len(row) == 4 and isinstance(row[2], str) else "?"
        where = f"{source}: layer {i} ({module})"
        if not isinstance(row, list) or len(row) != 4 or module == "?":
            raise SpecError(f"{where}: a row is [from, repeats, module name, args], got {row!r}")
        frm, repeats, _, args = row
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise SpecError(f"{where}: repeats must be an integer >= 1, got {repeats!r}")
        if args is None:
            args = []
        if not isinstance(args, list):
            raise SpecError(f"{where}: args must be a list, got {args!r}")
        parsed.append(Row(i, _absolute(frm, i, where), repeats, module, args, where))
    return parsed, len(backbone)


def _absolute(frm: Any, i: int, where: str) -> int | tuple[int, ...]:
    items = frm if isinstance(frm, list) else [frm]
    if not items or not all(isinstance(j, int) and not isinstance(j, bool) for j in items):
        raise SpecError(f"{where}: from must be a row index or a list of them, got {frm!r}")
    out = []
    for j in items:
        absolute = i + j if j < 0 else j
        if i == 0 and j == -1:
            absolute = -1   # the images
        elif not 0 <= absolute < i:
            reach = "-1 (the images)" if i == 0 else f"an earlier layer (0 to {i - 1}, or -1 to -{i})"
            raise SpecError(f"{where}: from {j} is not {reach}")
        out.append(absolute)
    return out[0] if not isinstance(frm, list) else tuple(out)


def _multipliers(spec: Mapping[str, Any], scale: str | None, source: str) -> tuple[float, float, float]:
    """(depth, width, max_channels) of the file at ``scale``."""
    if scale is not None:
        values = spec["scales"][scale]
        if (not isinstance(values, list) or len(values) != 3
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values)):
            raise SpecError(f"{source}: scale {scale!r} must be [depth, width, max_channels], got {values!r}")
        return float(values[0]), float(values[1]), float(values[2])
    depth, width = spec.get("depth_multiple", 1.0), spec.get("width_multiple", 1.0)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in (depth, width)):
        raise SpecError(f"{source}: depth_multiple and width_multiple must be positive numbers")
    return float(depth), float(width), math.inf


def _dry_run(layer: nn.Module, x: Tensor | list[Tensor]) -> Any:
    """``layer(x)`` on maps with an empty batch: output shapes without arithmetic.

    Parameters that are not on the CPU (a model built on the meta device or a GPU) are stood in
    for by uninitialised CPU tensors. A layer that rejects an empty batch runs once on a batch of
    one (zeros) instead. (The meta device would do too, but its kernels take seconds to load.)
    """
    tensors = dict(chain(layer.named_parameters(), layer.named_buffers()))
    on_cpu = all(t.device.type == "cpu" for t in tensors.values())
    stand_ins = tensors if on_cpu else {n: t if t.device.type == "cpu" else torch.empty(t.shape, dtype=t.dtype,
                                                                                         device="cpu")
                                        for n, t in tensors.items()}
    training = layer.training
    layer.eval()
    try:
        with torch.no_grad():
            try:
                return layer(x) if on_cpu else functional_call(layer, stand_ins, (x,))
            except Exception:  # noqa: BLE001 - an op without empty-batch support: one image of zeros
                one = _batch(x, 1)
                return _batch(layer(one) if on_cpu else functional_call(layer, stand_ins, (one,)), 0)
    finally:
        layer.train(training)


def _batch(x: Any, n: int) -> Any:
    """Zero tensors of the shapes of ``x`` (a tensor or a list of them) with batch ``n``."""
    if isinstance(x, Tensor):
        return torch.zeros((n, *x.shape[1:]), dtype=x.dtype, device="cpu")
    return [_batch(t, n) for t in x] if isinstance(x, (list, tuple)) else x


def build_spec_model(config: SpecConfig, *, modules: Modules | None = None, source: str | None = None,
                     weights: bool = True) -> Detector:
    """The Detector a ``SpecConfig`` describes, freshly initialised (layers built in row order).

    Args:
        config: the model file's content, scale and class count.
        modules: blocks for this build only (``{"MyBlock": MyBlock}``), besides the registered ones.
        source: how errors name the file (default: the config's name).
        weights: read the weights files rows name (a timm backbone's); False rebuilds the
            architecture only (a checkpoint then supplies every tensor).

    Raises:
        SpecError: an unknown module, a ``from`` that is not an earlier row, arguments the block
            rejects, maps that do not fit; the message names the file, the layer index and the module.
    """
    source = source or f"model spec {config.name!r}"
    spec = config.spec
    if spec.get("channels", 3) != 3:
        raise SpecError(f"{source}: yolokit models take 3-channel images, the file says channels: {spec['channels']}")
    if spec.get("activation") not in (None, "nn.SiLU()", "torch.nn.SiLU()"):
        raise SpecError(f"{source}: activation {spec['activation']!r} is not supported (the blocks use SiLU; "
                        "Darknet's leaky ReLU blocks are DarknetConv / DarknetResidual)")
    rows, n_backbone = parse_rows(spec, source)
    depth, width, max_channels = _multipliers(spec, config.scale, source)
    for row in rows[:-1]:
        if row.module in HEADS:
            raise SpecError(f"{row.where}: only the last row may be a head ({', '.join(HEADS)})")
    head_row = rows[-1]
    if head_row.module not in HEADS:
        raise SpecError(f"{head_row.where}: the last row must be a detection head ({', '.join(HEADS)})")
    symbols = {"nc": config.num_classes, "None": None, "anchors": spec.get("anchors")}
    outputs: dict[int, Any] = {-1: torch.empty(0, 3, DRY_SIZE, DRY_SIZE, device="cpu")}   # an empty batch: shapes only
    layers: list[tuple[int, nn.Module]] = []
    light = False
    for row in rows[:-1]:
        try:
            rule = module_rule(row.module, modules)
        except KeyError as exc:
            raise SpecError(f"{row.where}: {exc.args[0]}") from None
        light = light or rule.light_head
        x = _gather(outputs, row.sources)
        args = [symbols.get(a, a) if isinstance(a, str) else a for a in row.args]
        if not weights and rule.weights_at is not None and len(args) > rule.weights_at:
            args[rule.weights_at] = None
        layer = _make_layer(rule, row, args, _channels_of(x), (depth, width, max_channels), config.scale)
        try:
            y = _dry_run(layer, x)
        except Exception as exc:  # noqa: BLE001 - whatever the block raises, say which row it is
            raise SpecError(f"{row.where}: does not run on the maps it reads (channels x height x width for a "
                            f"{DRY_SIZE} x {DRY_SIZE} input: {_describe(x)}): {type(exc).__name__}: {exc}") from exc
        if not isinstance(y, Tensor) and not (isinstance(y, (list, tuple)) and all(isinstance(t, Tensor) for t in y)):
            raise SpecError(f"{row.where}: returned {type(y).__name__}, not a tensor or a list of tensors")
        outputs[row.index] = y
        layers.append((row.index, layer))
    head_args = [symbols.get(a, a) if isinstance(a, str) else a for a in head_row.args]
    head = _make_head(head_row, head_args, _gather(outputs, head_row.sources), spec, config.num_classes, light,
                      (depth, width, max_channels))
    backbone, neck = _graphs(rows, layers, outputs, n_backbone)
    return Detector(backbone, neck, head, config=config, name=config.name)


def _gather(outputs: Mapping[int, Any], sources: int | tuple[int, ...]) -> Any:
    return outputs[sources] if isinstance(sources, int) else [outputs[j] for j in sources]


def _channels_of(x: Any) -> int | list[Any]:
    return x.shape[1] if isinstance(x, Tensor) else [_channels_of(t) for t in x]


def _describe(x: Any) -> str:
    """Channels x height x width of the maps a layer reads (of the 256 x 256 dry input)."""
    return "x".join(str(v) for v in x.shape[1:]) if isinstance(x, Tensor) else ", ".join(_describe(t) for t in x)


def _stride(x: Tensor) -> int | float:
    stride = DRY_SIZE / x.shape[-2]
    return int(stride) if stride == int(stride) else stride


def _make_layer(rule: ModuleRule, row: Row, args: list[Any], c_in: Any, multipliers: tuple[float, float, float],
                scale: str | None) -> nn.Module:
    depth, width, max_channels = multipliers
    n = max(round(row.repeats * depth), 1) if row.repeats > 1 else row.repeats
    if rule.args == "channels":
        if not args or isinstance(args[0], bool) or not isinstance(args[0], (int, float)):
            raise SpecError(f"{row.where}: the first argument must be the output channels, got {row.args!r}")
        c_out = math.ceil(min(args[0], max_channels) * width / 8) * 8
        call, at = [c_in, c_out, *args[1:]], 2
    elif rule.args == "input":
        call, at = [c_in, *args], 1
    else:
        call, at = list(args), 0
    if rule.repeats == "inside":
        call.insert(at, n)
        n = 1
    if rule.adjust is not None:
        call = rule.adjust(call, scale)
    try:
        made = [rule.make(*call) for _ in range(n)]
    except Exception as exc:  # noqa: BLE001 - a bad argument, whatever the block raises: name the row
        raise SpecError(f"{row.where}: cannot be built from args {row.args!r} (called with {call!r}): "
                        f"{type(exc).__name__}: {exc}") from exc
    for m in made:
        if not isinstance(m, nn.Module):
            raise SpecError(f"{row.where}: {rule.make!r} returned {type(m).__name__}, not an nn.Module")
    return made[0] if n == 1 else nn.Sequential(*made)


def _make_head(row: Row, args: list[Any], maps: Any, spec: Mapping[str, Any], num_classes: int,
               light: bool, multipliers: tuple[float, float, float]) -> nn.Module:
    if row.repeats != 1:
        raise SpecError(f"{row.where}: a head row has repeats 1, got {row.repeats}")
    maps = [maps] if isinstance(maps, Tensor) else maps
    if not all(isinstance(m, Tensor) for m in maps):
        raise SpecError(f"{row.where}: reads a list of maps; pick them with Index rows first")
    in_channels, strides = [m.shape[1] for m in maps], [_stride(m) for m in maps]
    if not all(isinstance(s, int) for s in strides):
        raise SpecError(f"{row.where}: the maps it reads have strides {strides} (a {DRY_SIZE}-pixel input); "
                        "every level needs a whole stride")
    expected = {"AnchorDetect": 2, "Segment": 3, "Segment26": 3}.get(row.module, 1)
    if not args or args[0] != num_classes or len(args) > expected:
        form = {1: "[nc]", 2: "[nc, anchors]", 3: "[nc, masks, prototype channels]"}[expected]
        raise SpecError(f"{row.where}: args are {form} with nc the class count ({num_classes}), got {row.args!r}")
    if row.module == "AnchorDetect":
        anchors = args[1] if len(args) == 2 else spec.get("anchors")
        return AnchorHead(in_channels, strides, _anchor_pairs(anchors, len(maps), row.where), num_classes=num_classes)
    reg_max, end2end = spec.get("reg_max", 16), spec.get("end2end", False)
    if isinstance(reg_max, bool) or not isinstance(reg_max, int) or reg_max < 1:
        raise SpecError(f"{row.where}: reg_max must be an integer >= 1, got {reg_max!r}")
    if not isinstance(end2end, bool):
        raise SpecError(f"{row.where}: end2end must be true or false, got {end2end!r}")
    if row.module == "Detect":
        kind = EndToEndHead if end2end else DFLHead
        return kind(in_channels, strides, num_classes=num_classes, reg_max=reg_max, light_cls=light)
    masks = args[1] if len(args) > 1 else 32
    channels = args[2] if len(args) > 2 else 256
    for name, value in (("masks", masks), ("prototype channels", channels)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SpecError(f"{row.where}: {name} must be an integer >= 1, got {value!r}")
    if end2end != (row.module == "Segment26"):
        raise SpecError(f"{row.where}: {row.module} needs end2end: {str(row.module == 'Segment26').lower()} "
                        "(Segment: the one-branch head with NMS; Segment26: YOLO26's end-to-end head)")
    kind = EndToEndSegmentHead if end2end else SegmentHead
    return kind(in_channels, strides, num_classes=num_classes, num_masks=masks, reg_max=reg_max, light_cls=light,
                proto_channels=proto_channels(channels, multipliers[1], multipliers[2]))


def _anchor_pairs(anchors: Any, levels: int, where: str) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per level, (w, h) pairs in pixels: ``[[w, h], ...]`` or flat ``[w, h, w, h, ...]`` per level."""
    if not isinstance(anchors, list) or len(anchors) != levels:
        raise SpecError(f"{where}: anchors must be one list per level ({levels}), got {anchors!r}")
    out = []
    for level in anchors:
        flat = list(chain.from_iterable(p if isinstance(p, list) else [p] for p in level)) if isinstance(
            level, list) else None
        if not flat or len(flat) % 2 or not all(isinstance(v, (int, float)) and v > 0 for v in flat):
            raise SpecError(f"{where}: each level's anchors are (w, h) pairs in pixels, got {level!r}")
        out.append(tuple((int(flat[k]), int(flat[k + 1])) for k in range(0, len(flat), 2)))
    return tuple(out)


def _graphs(rows: list[Row], layers: list[tuple[int, nn.Module]], outputs: Mapping[int, Any],
            n_backbone: int) -> tuple[LayerGraph, LayerGraph]:
    """The backbone graph (rows before ``n_backbone``) and the neck graph (the rest but the head)."""
    head = rows[-1]

    def reads(row: Row) -> tuple[int, ...]:
        return (row.sources,) if isinstance(row.sources, int) else row.sources

    crossing = sorted({j for row in rows[n_backbone:] for j in reads(row) if 0 <= j < n_backbone})
    for j in crossing:
        if not isinstance(outputs[j], Tensor):
            raise SpecError(f"{rows[j].where}: its output (a list of maps) is read after the backbone; "
                            "pick its maps with Index rows in the backbone")
    head_maps = reads(head)

    def graph(part: list[Row], layer_list: list[tuple[int, nn.Module]], inputs: tuple[int, ...],
              outs: tuple[int, ...]) -> LayerGraph:
        return LayerGraph(layer_list, [r.sources for r in part], inputs=inputs, outputs=outs,
                          out_channels=[outputs[j].shape[1] for j in outs], strides=[_stride(outputs[j]) for j in outs])

    backbone = graph(rows[:n_backbone], layers[:n_backbone], (-1,), tuple(crossing))
    neck = graph(rows[n_backbone:-1], layers[n_backbone:], tuple(crossing), tuple(head_maps))
    return backbone, neck


def spec_head_facts(config: SpecConfig, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, int] | None:
    """The class count a state dict's head tensors show for a spec model, or None when they do not fit."""
    cls = shapes.get("head.cls.0.2.weight")
    if cls is not None:
        return {"num_classes": cls[0]}
    pred = shapes.get("head.preds.0.weight")
    anchors = config.spec.get("anchors")
    if pred is None or not isinstance(anchors, list) or not anchors:
        return None
    per_level = len(_anchor_pairs(anchors, len(anchors), config.name)[0])
    if pred[0] % per_level or pred[0] // per_level <= 5:
        return None
    return {"num_classes": pred[0] // per_level - 5}
