"""``load`` and ``save``: recognise a weights file by its bytes and hand it to its reader.

=============  ===================================  ====================================
format         recognised by                        reader
=============  ===================================  ====================================
safetensors    u64 header length, then ``{``         yolokit file (config in metadata)
                                                     or a plain state dict (either naming)
torch          zip archive or a pickle               yolokit dict, Ultralytics checkpoint
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
from pathlib import Path
from typing import Any

from yolokit.interop.darknet import load_darknet, load_darknet_model, looks_like_darknet, save_darknet
from yolokit.interop.native import (
    attach_names,
    from_contents,
    from_torch_object,
    is_safetensors_file,
    native_config,
    read_safetensors,
    save_native,
)
from yolokit.interop.safe_load import load_pickled
from yolokit.interop.state import build_from_state_dict
from yolokit.interop.ultralytics import is_ultralytics_state_dict, ultralytics_contents, ultralytics_to_yolokit
from yolokit.models import Detector


def file_format(path: str | Path) -> str:
    """The format of a weights file, from its first bytes (and suffix): "safetensors", "torch" or "darknet".

    Raises:
        FileNotFoundError: no such file.
        ValueError: none of these; the message names the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if is_safetensors_file(path):
        return "safetensors"
    with open(path, "rb") as f:
        first = f.read(2)
    if zipfile.is_zipfile(path) or first[:1] == b"\x80":  # torch zip archive, or a (legacy) pickle
        return "torch"
    if looks_like_darknet(path):
        return "darknet"
    if path.suffix == ".weights":
        raise ValueError(f"{path}: named .weights but not a Darknet weights file (its header is no small "
                         "version number followed by whole float32 values)")
    raise ValueError(f"{path}: unknown weights format (not safetensors, not a torch file, not a Darknet "
                     ".weights); yolokit reads .safetensors, .pt/.pth (yolokit, Ultralytics) and .weights")


def load(path: str | Path, *, model: str | Detector | None = None) -> Detector:
    """A ready Detector (eval mode) from any weights file yolokit reads.

    yolokit files (safetensors or torch) rebuild their stored config; Ultralytics YOLOv8
    checkpoints and plain state dicts give their variant and class count through their
    tensor shapes; Darknet ``.weights`` give their variant and class count through their
    size (name the variant when several fit). Stored class names are attached as
    ``model.names``. Nothing in a file is ever run: pickles go through
    ``torch.load(weights_only=True)`` with inert stand-ins for Ultralytics' classes.

    Args:
        path: the file.
        model: None, a variant name (checked, or used to pick the variant), or a
            Detector to load the weights into.

    Raises:
        UnsafeFileError: a pickle that refers to functions or classes outside the allowlist.
        ValueError: unknown format, wrong class count, shape mismatch (the message names the file).

    Example:
        >>> yolokit.load("yolov8n.pt").name  # Ultralytics checkpoint
        'yolov8n'
        >>> yolokit.load("yolov8n.pt").names[:2]
        ['person', 'bicycle']
        >>> yolokit.load("yolov3-tiny.weights").num_classes
        80
    """
    path, source = Path(path), str(path)
    kind = file_format(path)
    if kind == "darknet":
        if isinstance(model, Detector):
            model.darknet_header = load_darknet(model, path)
            return model.eval()
        return load_darknet_model(path, model)
    if kind == "safetensors":
        state, metadata = read_safetensors(path)
        config = native_config(metadata, source=source)
        if config is None and is_ultralytics_state_dict(state):
            state = ultralytics_to_yolokit(state, source=source)
        return attach_names(from_contents(state, config, model=model, source=source), metadata.get("names"))
    def from_ultralytics(obj: Any) -> Detector | None:
        contents = ultralytics_contents(obj)
        if contents is None:
            return None
        state = ultralytics_to_yolokit(contents.state_dict, source=source)
        return attach_names(build_from_state_dict(state, model=model, source=source), contents.class_names)

    return from_torch_object(load_pickled(path), model=model, source=source, other=from_ultralytics,
                             what="a torch file, but neither a yolokit file, an Ultralytics checkpoint nor a "
                                  "state dict of tensors")


def save(model: Detector, path: str | Path) -> Path:
    """Writes ``model`` in the format its suffix names.

    ``.safetensors`` (recommended) and ``.pt`` / ``.pth`` are yolokit files that
    ``load`` rebuilds without being told the variant; ``.weights`` writes Darknet's
    format (YOLOv3 family; a header kept from a loaded ``.weights`` file is written back,
    so the bytes round-trip exactly).

    Example:
        >>> yolokit.save(yolokit.create_model("yolov8n"), "yolov8n.safetensors")
        PosixPath('yolov8n.safetensors')
    """
    path = Path(path)
    if path.suffix == ".weights":
        return save_darknet(model, path)
    return save_native(model, path)
