"""``load`` and ``save``: recognise a weights file by its bytes and hand it to its reader.

``FORMATS`` is the one table: each format's suffixes, how its bytes are recognised, its
reader and its writer.

=============  ===================================  ====================================
format         recognised by                        reader
=============  ===================================  ====================================
safetensors    u64 header length, then ``{``         yolokit file (config in metadata)
                                                     or a plain state dict (either naming)
torch          zip archive or a pickle               yolokit dict, yolokit training
                                                     checkpoint, Ultralytics checkpoint
                                                     or plain state dict; always
                                                     ``weights_only=True``
darknet        a Darknet header (small version,      variant and class count from the
               ``seen``), whole float32s after it   size (``model`` may name the variant)
=============  ===================================  ====================================

Class names travel with the model: ``Detector.names`` is set from an Ultralytics
checkpoint's ``names``, a yolokit run's ``model.pt`` and yolokit files that stored them.
"""

from __future__ import annotations

import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from yolokit.interop.darknet import load_darknet, load_darknet_model, looks_like_darknet, save_darknet
from yolokit.interop.native import from_safetensors_file, from_torch_object, is_safetensors_file, save_native
from yolokit.interop.safe_load import load_pickled
from yolokit.interop.ultralytics import (
    detector_from_checkpoint,
    is_ultralytics_state_dict,
    ultralytics_contents,
    yolokit_state,
)
from yolokit.models import Detector


def _read_safetensors(path: Path, model: str | Detector | None) -> Detector:
    """A yolokit safetensors file, or a plain state dict (yolokit or Ultralytics naming)."""
    def rename(state: dict) -> dict:
        return yolokit_state(state, model=model, source=str(path)) if is_ultralytics_state_dict(state) else state

    return from_safetensors_file(path, model=model, convert=rename)


def _read_torch(path: Path, model: str | Detector | None) -> Detector:
    """A yolokit torch file, a yolokit training checkpoint, an Ultralytics checkpoint or a plain state
    dict (``weights_only`` always)."""
    source = str(path)

    def from_ultralytics(obj: Any) -> Detector | None:
        contents = ultralytics_contents(obj)
        return None if contents is None else detector_from_checkpoint(contents, model=model, source=source)

    return from_torch_object(load_pickled(path), model=model, source=source, other=from_ultralytics,
                             what="a torch file, but neither a yolokit file, an Ultralytics checkpoint nor a "
                                  "state dict of tensors")


def _read_darknet(path: Path, model: str | Detector | None) -> Detector:
    """Darknet ``.weights``: into the given Detector, or a new one of the variant the size gives."""
    if isinstance(model, Detector):
        load_darknet(model, path)
        return model.eval()
    return load_darknet_model(path, model)


@dataclass(frozen=True)
class Format:
    """One weights format: how it is recognised, read and written.

    Attributes:
        name: the format's name (``file_format`` returns it).
        suffixes: file suffixes ``save`` writes in this format (empty: read only).
        recognise: whether a file's bytes are of this format.
        read: ``read(path, model)`` -> a ready Detector.
        write: ``write(model, path, **options)`` -> the path (None: read only).
    """

    name: str
    suffixes: tuple[str, ...]
    recognise: Callable[[Path], bool]
    read: Callable[[Path, str | Detector | None], Detector]
    write: Callable[..., Path] | None


def _is_torch_file(path: Path) -> bool:
    with open(path, "rb") as f:
        first = f.read(1)
    return zipfile.is_zipfile(path) or first == b"\x80"  # torch zip archive, or a (legacy) pickle


# The one table of formats, in the order files are tried.
FORMATS = (
    Format("safetensors", (".safetensors",), is_safetensors_file, _read_safetensors, save_native),
    Format("torch", (".pt", ".pth"), _is_torch_file, _read_torch, save_native),
    Format("darknet", (".weights",), looks_like_darknet, _read_darknet, save_darknet),
)


def file_format(path: str | Path) -> str:
    """The format of a weights file, from its first bytes: "safetensors", "torch" or "darknet".

    Raises:
        FileNotFoundError: no such file.
        ValueError: none of these; the message names the file.
    """
    return _format_of(Path(path)).name


def _format_of(path: Path) -> Format:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    for fmt in FORMATS:
        if fmt.recognise(path):
            return fmt
    if path.suffix == ".weights":
        raise ValueError(f"{path}: named .weights but not a Darknet weights file (its header is no small "
                         "version number followed by whole float32 values)")
    raise ValueError(f"{path}: unknown weights format (not safetensors, not a torch file, not a Darknet "
                     ".weights); yolokit reads .safetensors, .pt/.pth (yolokit, Ultralytics) and .weights")


def load(path: str | Path, *, model: str | Detector | None = None) -> Detector:
    """A ready Detector (eval mode) from any weights file yolokit reads.

    yolokit files and training checkpoints (safetensors or torch) rebuild their stored config
    (a model YAML's config holds the file's content); Ultralytics YOLOv8 checkpoints and plain
    state dicts give their variant and class count through their tensor shapes, other
    Ultralytics architectures (YOLO11, P2/P6, YOLOv5u, ...) are built from the model file
    their checkpoint carries; Darknet ``.weights`` give their variant and class count through their
    size (name the variant when several fit). Stored class names are attached as
    ``model.names``. Nothing in a file is ever run: pickles go through
    ``torch.load(weights_only=True)`` with inert stand-ins for Ultralytics' classes.

    Args:
        path: the file.
        model: None, a variant name (checked, or used to pick the variant), or a
            Detector to load the weights into (a model YAML's Detector takes a state dict in
            Ultralytics' naming of that architecture).

    Raises:
        UnsafeFileError: a pickle that refers to functions or classes outside the allowlist.
        ValueError: unknown format, wrong class count, shape mismatch (the message names the file).

    Examples:
        >>> yolokit.load("yolov8n.pt").name  # Ultralytics checkpoint
        'yolov8n'
        >>> yolokit.load("yolov8n.pt").names[:2]
        ['person', 'bicycle']
        >>> yolokit.load("yolov3-tiny.weights").num_classes
        80
    """
    path = Path(path)
    return _format_of(path).read(path, model)


def save(model: Detector, path: str | Path, **options: Any) -> Path:
    """Writes ``model`` in the format its suffix names.

    ``.safetensors`` (recommended) and ``.pt`` / ``.pth`` are yolokit files that
    ``load`` rebuilds without being told the variant (options: ``names``, ``half``,
    ``extra``; see ``save_native``); ``.weights`` writes Darknet's format (YOLOv3 family;
    option ``header``: pass ``read_darknet_header(source)`` to write back a loaded file's
    bytes exactly).

    Examples:
        >>> yolokit.save(yolokit.create_model("yolov8n"), "yolov8n.safetensors")
        PosixPath('yolov8n.safetensors')
    """
    path = Path(path)
    for fmt in FORMATS:
        if path.suffix in fmt.suffixes and fmt.write is not None:
            return fmt.write(model, path, **options)
    known = ", ".join(s for fmt in FORMATS if fmt.write for s in fmt.suffixes)
    raise ValueError(f"{path}: unknown suffix {path.suffix!r}; yolokit writes {known}")
