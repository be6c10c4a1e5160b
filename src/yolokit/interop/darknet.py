"""Darknet ``.weights`` for the YOLOv3 family: read into yolokit, write back byte-identical.

A ``.weights`` file is a header, then float32 little-endian values, convolution after
convolution in the order the cfg lists them (``darknet_order``):

- header: int32 ``major``, ``minor``, ``revision``, then ``seen`` (images seen in
  training) as int64 when ``major * 10 + minor >= 2`` and both are below 1000, else int32;
- a convolution with batch norm: bn bias (beta), bn weight (gamma), running mean,
  running var, then the conv weight ``[out, in, k, k]``;
- a convolution without batch norm (the detection layers): conv bias, conv weight.

The file does not say which network it belongs to. It is recognised by its header (a
small version number, then ``seen``) and by its size: the number of values fits one
variant of the family with a whole number of classes (``darknet_fits``). The caller may
name the variant; a file that does not fit it is refused with what it does fit.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from yolokit.models import MODELS, Detector, YOLOv3Config, build_model
from yolokit.models.layers import Conv


@dataclass(frozen=True)
class DarknetHeader:
    """The header of a ``.weights`` file; kept so that writing back gives the same bytes.

    Attributes:
        major, minor, revision: Darknet's format version.
        seen: images seen in training.
    """

    major: int = 0
    minor: int = 2
    revision: int = 0
    seen: int = 0

    @property
    def wide_seen(self) -> bool:
        """Whether ``seen`` is stored as int64 (else int32)."""
        return self.major * 10 + self.minor >= 2 and self.major < 1000 and self.minor < 1000

    @property
    def nbytes(self) -> int:
        return 12 + (8 if self.wide_seen else 4)

    def to_bytes(self) -> bytes:
        return struct.pack("<3i", self.major, self.minor, self.revision) + struct.pack(
            "<q" if self.wide_seen else "<i", self.seen)

    @classmethod
    def from_bytes(cls, data: bytes, *, source: str = "header") -> DarknetHeader:
        if len(data) < 12:
            raise ValueError(f"{source}: too short for a Darknet header ({len(data)} bytes)")
        major, minor, revision = struct.unpack("<3i", data[:12])
        header = cls(major, minor, revision, 0)
        if min(major, minor, revision) < 0 or len(data) < header.nbytes:
            raise ValueError(f"{source}: not a Darknet .weights header (version {major}.{minor}.{revision})")
        (seen,) = struct.unpack("<q" if header.wide_seen else "<i", data[12:header.nbytes])
        return replace(header, seen=seen)


def darknet_order(model: Detector) -> list[nn.Module]:
    """The model's convolutions in the order Darknet's cfg lists its [convolutional] layers.

    ``Conv`` blocks (conv + batch norm) and the head's plain ``nn.Conv2d`` (with bias).
    Backbone first, then per level from stride 32 down: the five-conv block, the output
    conv, the detection conv and the lateral 1x1 (tiny: block5, out5, head 1, lateral5,
    out4, head 0).
    """
    config = model.config
    if not isinstance(config, YOLOv3Config):
        raise ValueError(f"Darknet weights exist for the YOLOv3 family only, not {model.name}")

    def convs(m: nn.Module) -> list[nn.Module]:
        return [c for c in m.modules() if isinstance(c, Conv)]

    neck, preds = model.neck, model.head.preds
    order = convs(model.backbone)
    if config.form == "tiny":
        order += convs(neck.block5) + convs(neck.out5) + [preds[1]] + convs(neck.lateral5) + convs(neck.out4)
        return order + [preds[0]]
    for level, pred in ((5, preds[2]), (4, preds[1]), (3, preds[0])):
        order += convs(getattr(neck, f"block{level}")) + convs(getattr(neck, f"out{level}")) + [pred]
        if level > 3:
            order += convs(getattr(neck, f"lateral{level}"))
    return order


def layer_tensors(layer: nn.Module) -> list[Tensor]:
    """The tensors of one convolution in Darknet's file order."""
    if isinstance(layer, Conv):
        bn = layer.bn
        if not isinstance(bn, nn.BatchNorm2d):
            raise ValueError("a fused model cannot be written as Darknet weights; save it before fuse()")
        return [bn.bias, bn.weight, bn.running_mean, bn.running_var, layer.conv.weight]
    return [layer.bias, layer.weight]


def darknet_count(model: Detector) -> int:
    """How many float values the model's ``.weights`` file holds after the header."""
    return sum(t.numel() for layer in darknet_order(model) for t in layer_tensors(layer))


def read_darknet(path: str | Path) -> tuple[DarknetHeader, np.ndarray]:
    """The header and all values of a ``.weights`` file (float32, in file order)."""
    path = Path(path)
    with open(path, "rb") as f:
        header = DarknetHeader.from_bytes(f.read(20), source=str(path))
        f.seek(header.nbytes)
        values = np.fromfile(f, dtype="<f4")
    if (path.stat().st_size - header.nbytes) % 4:
        raise ValueError(f"{path}: {path.stat().st_size - header.nbytes} bytes after the header "
                         "is not a whole number of float32 values")
    return header, values


def read_darknet_header(path: str | Path) -> DarknetHeader:
    """The header of a ``.weights`` file (version and ``seen``), without reading the values."""
    with open(path, "rb") as f:
        return DarknetHeader.from_bytes(f.read(20), source=str(path))


def load_darknet(model: Detector, path: str | Path, *, strict: bool = True) -> DarknetHeader:
    """Fills ``model`` in place from a ``.weights`` file; returns the header.

    Args:
        model: a yolov3 / yolov3-spp / yolov3-tiny Detector with the file's class count.
        path: the ``.weights`` file.
        strict: the file must hold exactly the model's values. With False a shorter file
            (a pretrained backbone such as ``darknet53.conv.74``) fills the leading layers;
            it must still end on a layer boundary.

    Raises:
        ValueError: the number of values does not fit (the message names the file).
    """
    header, values = read_darknet(path)
    _fill(model, values, source=str(path), strict=strict)
    return header


@torch.no_grad()
def _fill(model: Detector, values: np.ndarray, *, source: str, strict: bool = True) -> None:
    need = darknet_count(model)
    if len(values) > need or (strict and len(values) != need):
        fits = darknet_fits(len(values))
        hint = (f"it fits {' or '.join(f'{n} with {c} classes' for n, c in fits)}" if fits
                else f"is it a {model.name} file, with that class count?")
        raise ValueError(f"{source}: holds {len(values):,} values after its header but {model.name} with "
                         f"{model.num_classes} classes needs {need:,}; {hint}")
    pos = 0
    for layer in darknet_order(model):
        if pos == len(values):
            break
        tensors = layer_tensors(layer)
        if pos + sum(t.numel() for t in tensors) > len(values):
            raise ValueError(f"{source}: ends inside a layer ({len(values):,} values)")
        for t in tensors:
            t.copy_(torch.from_numpy(values[pos:pos + t.numel()].reshape(t.shape)))
            pos += t.numel()


def save_darknet(model: Detector, path: str | Path, *, header: DarknetHeader | None = None) -> Path:
    """Writes ``model`` as a Darknet ``.weights`` file.

    Args:
        model: a YOLOv3-family Detector (not fused).
        path: destination.
        header: header to write (``read_darknet_header(source)`` writes a loaded file's
            bytes back identically); default version 0.2.0 with ``seen`` 0.
    """
    path = Path(path)
    header = header or DarknetHeader()
    layers = darknet_order(model)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(header.to_bytes())
        for layer in layers:
            for t in layer_tensors(layer):
                f.write(t.detach().to("cpu", torch.float32).numpy().astype("<f4", copy=False).tobytes())
    os.replace(tmp, path)
    return path


def looks_like_darknet(path: str | Path) -> bool:
    """Whether a file starts with a plausible Darknet header and holds whole float32 values after it.

    The version numbers must be small (each below 100; published files are 0.1.0 to
    0.2.5) and ``seen`` not negative.
    """
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(20)
    try:
        header = DarknetHeader.from_bytes(head)
    except ValueError:
        return False
    body = path.stat().st_size - header.nbytes
    return max(header.major, header.minor, header.revision) < 100 and header.seen >= 0 and body > 0 and body % 4 == 0


def _count_rule(name: str) -> tuple[int, int]:
    """(values for 1 class, values per extra class) of variant ``name``'s ``.weights``."""
    with torch.device("meta"):
        one, two = (darknet_count(build_model(replace(MODELS[name], num_classes=c))) for c in (1, 2))
    return one, two - one


def darknet_fits(count: int) -> list[tuple[str, int]]:
    """Every (YOLOv3-family variant, class count) whose ``.weights`` hold exactly ``count`` values."""
    fits = []
    for name, config in MODELS.items():
        if isinstance(config, YOLOv3Config):
            one, per_class = _count_rule(name)
            classes, rest = divmod(count - one, per_class)
            if not rest and classes >= 0:
                fits.append((name, classes + 1))
    return fits


def darknet_num_classes(name: str, count: int, *, source: str = "file") -> int:
    """The class count for which variant ``name`` has ``count`` values in its ``.weights`` file.

    Raises:
        ValueError: ``name`` is no YOLOv3-family variant, or no class count fits; the
            message says which variants the file does fit, if any.
    """
    base = MODELS.get(name)
    if not isinstance(base, YOLOv3Config):
        yolov3 = [n for n, c in MODELS.items() if isinstance(c, YOLOv3Config)]
        raise ValueError(f"{source}: Darknet weights need a YOLOv3-family variant ({', '.join(yolov3)}), got {name!r}")
    one, per_class = _count_rule(name)
    classes, rest = divmod(count - one, per_class)
    if rest or classes < 0:
        fits = darknet_fits(count)
        hint = (f"; it fits {' or '.join(f'{n} with {c} classes' for n, c in fits)}" if fits
                else f"; is it a {name} file?")
        raise ValueError(f"{source}: {count:,} values after the header fit no class count of {name} "
                         f"({one:,} for 1 class, +{per_class:,} per class){hint}")
    return classes + 1


def darknet_variant(count: int, *, source: str = "file") -> str:
    """The one YOLOv3-family variant a ``.weights`` file of ``count`` values fits.

    Raises:
        ValueError: none fits, or several do (the caller must then name the variant).
    """
    fits = darknet_fits(count)
    if len(fits) == 1:
        return fits[0][0]
    if not fits:
        rules = ", ".join(f"{n}: {one:,} + {per:,} per class beyond 1" for n, (one, per) in
                          ((n, _count_rule(n)) for n, c in MODELS.items() if isinstance(c, YOLOv3Config)))
        raise ValueError(f"{source}: a Darknet .weights header, but its {count:,} values fit no YOLOv3-family "
                         f"variant ({rules}); Darknet .weights do not say which network they hold, and this "
                         "one is not yolov3, yolov3-spp or yolov3-tiny with a whole class count")
    raise ValueError(f"{source}: Darknet .weights do not say which network they hold and {count:,} values fit "
                     f"{' and '.join(f'{n} ({c} classes)' for n, c in fits)}; pass model=<variant>")


def load_darknet_model(path: str | Path, name: str | None = None) -> Detector:
    """A ready Detector (eval mode) for variant ``name`` from a ``.weights`` file.

    The class count (and without ``name`` the variant, when only one fits) is read from
    the file size. ``save_darknet(model, path, header=read_darknet_header(source))``
    writes the same bytes back.

    Examples:
        >>> model = load_darknet_model("yolov3-tiny.weights", "yolov3-tiny")
        >>> model.num_classes, read_darknet_header("yolov3-tiny.weights").minor
        (80, 2)
    """
    _, values = read_darknet(path)
    name = name or darknet_variant(len(values), source=str(path))
    num_classes = darknet_num_classes(name, len(values), source=str(path))
    with torch.device("meta"):
        model = build_model(replace(MODELS[name], num_classes=num_classes))
    model = model.to_empty(device="cpu")
    for buffer_name, buffer in model.named_buffers():
        if buffer_name.endswith("num_batches_tracked"):
            buffer.zero_()
    _fill(model, values, source=str(path))
    return model.eval()
