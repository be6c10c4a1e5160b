"""yolokit's own files: safetensors with the model config, or a ``torch.save``-d dict.

- ``.safetensors``: the state dict, and in the header metadata ``format`` = "yolokit",
  ``format_version``, ``config`` = the JSON of ``asdict(model.config)`` and, when the
  model has class names, ``names`` = their JSON list.
- ``.pt`` / ``.pth``: ``{"format": "yolokit", "format_version": 1, "config":
  asdict(config), "state_dict": {...}}`` (plus ``"names"``), read back with
  ``torch.load(weights_only=True)``.
- a training checkpoint (``weights/last.pt``): the model is rebuilt from its ``model_config``
  and given the weights under ``model``.

A model YAML's config holds the file's content (``models.SpecConfig``): blocks of the user's
it names must be registered (``yolokit.models.register_module``) before such a file loads.

Plain state dicts in yolokit's naming (either container) load too: the variant and
class count are then read from the tensor shapes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from yolokit.interop.safe_load import load_pickled
from yolokit.interop.state import blank_model, build_from_state_dict, is_fused, load_checked
from yolokit.models import Detector, SpecError, config_from_dict

FORMAT = "yolokit"
FORMAT_VERSION = 1
TORCH_SUFFIXES = (".pt", ".pth")


def save_native(model: Detector, path: str | Path, *, names: Sequence[str] | None = None, half: bool = False,
                extra: Mapping[str, Any] | None = None) -> Path:
    """Writes ``model``'s weights and config: safetensors for ``.safetensors``, else ``torch.save``.

    The file is written next to ``path``, flushed to disk and moved into place, so a crash
    never leaves half a file under the final name.

    Args:
        model: a Detector built from a config (``create_model``, ``build_model``, ``load``).
        path: ``.safetensors``, ``.pt`` or ``.pth``.
        names: class names to store (default: the model's, when it has real ones).
        half: store floating-point tensors as float16 (inference files).
        extra: more JSON-able entries to store beside the config (e.g. a run's training
            config); safetensors keeps each as JSON text in its metadata.

    Examples:
        >>> save_native(create_model("yolov8n", num_classes=3), "tiny.safetensors")
        PosixPath('tiny.safetensors')
    """
    path = Path(path)
    if path.suffix not in (".safetensors", *TORCH_SUFFIXES):
        raise ValueError(f"{path}: unknown suffix {path.suffix!r}; use .safetensors, .pt or .pth")
    contents = native_contents(model, names=names, half=half, extra=extra, source=path)
    tmp = path.with_name(path.name + ".tmp")
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        state = contents.pop("state_dict")
        metadata = {k: (str(v) if k == "format_version" else v if k == "format" else json.dumps(v))
                    for k, v in contents.items()}
        save_file(state, str(tmp), metadata=metadata)
    else:
        with open(tmp, "wb") as f:
            torch.save(contents, f)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def native_contents(model: Detector, *, names: Sequence[str] | None = None, half: bool = False,
                    extra: Mapping[str, Any] | None = None, source: str | Path = "") -> dict[str, Any]:
    """What :func:`save_native` writes to a ``.pt`` file, as a dict (``torch.save`` it as it is):
    ``format``, ``format_version``, ``state_dict``, ``config``, ``names`` when known, and ``extra``."""
    if model.config is None:
        raise ValueError(f"{source}: {model.name} has no config to store; build it with create_model or build_model")
    state = {k: (v.detach().half() if half and v.is_floating_point() else v.detach()).cpu().contiguous()
             for k, v in model.state_dict().items()}
    names = list(names) if names is not None else (model.names if model.has_names else None)
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "state_dict": state, "config": asdict(model.config),
            **({"names": [str(n) for n in names]} if names else {}), **dict(extra or {})}


def from_safetensors_file(path: str | Path, *, model: str | Detector | None,
                          convert: Callable[[dict[str, Tensor]], dict[str, Tensor]] | None = None) -> Detector:
    """A ready Detector from a safetensors file: a yolokit file (its stored config and names),
    else a plain state dict, renamed by ``convert`` first when given."""
    source = str(path)
    state, metadata = read_safetensors(path)
    config = native_config(metadata, source=source)
    if config is None and convert is not None:
        state = convert(state)
    return attach_names(from_contents(state, config, model=model, source=source), metadata.get("names"))


def attach_names(model: Detector, names: Any) -> Detector:
    """Sets ``model.names`` from what a file stored (a list, an ``{index: name}`` dict or their
    JSON); anything else, or names of another class count, leaves the model as it is."""
    if isinstance(names, str):
        try:
            names = json.loads(names)
        except ValueError:
            return model
    if isinstance(names, Mapping):
        try:
            names = {int(k): str(v) for k, v in names.items()}
        except (TypeError, ValueError):
            return model
        names = [names.get(i, str(i)) for i in range(model.num_classes)] if len(names) == model.num_classes else None
    if isinstance(names, (list, tuple)) and len(names) == model.num_classes:
        model.names = [str(n) for n in names]
    return model


def read_safetensors(path: str | Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """All tensors of a safetensors file (on the CPU) and its header metadata."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = dict(f.metadata() or {})
            return {k: f.get_tensor(k) for k in f.keys()}, metadata  # noqa: SIM118 (safe_open is no dict)
    except SafetensorError as exc:
        raise ValueError(f"{path}: not a readable safetensors file ({exc})") from exc


def is_native(obj: Any) -> bool:
    """True for the dict ``save_native`` writes through ``torch.save``."""
    return isinstance(obj, Mapping) and obj.get("format") == FORMAT


def state_dict_in(obj: Any) -> dict[str, Tensor] | None:
    """The state dict inside a torch-loaded object: the object itself, or under "state_dict" / "model"."""
    for candidate in (obj, *(obj.get(k) for k in ("state_dict", "model") if isinstance(obj, Mapping))):
        if isinstance(candidate, Mapping) and candidate and all(
                isinstance(k, str) and isinstance(v, Tensor) for k, v in candidate.items()):
            return dict(candidate)
    return None


def from_contents(state: Mapping[str, Tensor], config: Mapping[str, Any] | None, *,
                  model: str | Detector | None, source: str) -> Detector:
    """A ready Detector from a state dict and (when the file has one) its stored config."""
    if config is None:
        return build_from_state_dict(state, model=model, source=source)
    try:
        stored = config_from_dict(dict(config))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: stored model config is not valid ({exc})") from exc
    if isinstance(model, Detector):
        return load_checked(model, state, source=source)
    if model is not None and model != stored.name:
        raise ValueError(f"{source}: holds a {stored.name} but model={model!r} was asked for")
    try:
        blank = blank_model(stored, fused=is_fused(state), covered=state.keys())
    except SpecError as exc:   # a model YAML's config naming a block that is not registered, say
        raise SpecError(f"{source}: {exc}") from exc
    return load_checked(blank, state, source=source)


def native_config(obj_or_metadata: Mapping[str, Any], *, source: str) -> dict[str, Any] | None:
    """The stored config of a native torch dict or safetensors metadata (None when absent)."""
    if obj_or_metadata.get("format") != FORMAT:
        return None
    try:
        version = int(obj_or_metadata.get("format_version", FORMAT_VERSION))
        config = obj_or_metadata.get("config")
        config = json.loads(config) if isinstance(config, str) else config
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: damaged yolokit header ({exc})") from exc
    if version > FORMAT_VERSION:
        raise ValueError(f"{source}: yolokit format version {version} is newer than this yolokit reads "
                         f"({FORMAT_VERSION}); upgrade yolokit")
    if not isinstance(config, Mapping):
        raise ValueError(f"{source}: yolokit file without a model config")
    return dict(config)


def is_training_checkpoint(obj: Any) -> bool:
    """True for a yolokit training checkpoint (``last.pt``): the model's ``state_dict`` under "model" and
    ``asdict(model.config)`` under "model_config" (and, read in their place when there, the EMA's under
    "ema"/"module" and the class names under "names")."""
    return (isinstance(obj, Mapping) and isinstance(obj.get("model_config"), Mapping)
            and isinstance(obj.get("model"), Mapping) and all(isinstance(v, Tensor) for v in obj["model"].values()))


def from_native_object(obj: Mapping[str, Any], *, model: str | Detector | None, source: str) -> Detector:
    """A ready Detector from the dict ``save_native`` writes through ``torch.save``."""
    config = native_config(obj, source=source)
    state = state_dict_in(obj)
    if state is None:
        raise ValueError(f"{source}: yolokit file without a state_dict")
    return attach_names(from_contents(state, config, model=model, source=source), obj.get("names"))


def load_native(path: str | Path, *, model: str | Detector | None = None) -> Detector:
    """A ready Detector (eval mode) from a yolokit file or a plain state dict in yolokit's naming.

    Args:
        path: ``.safetensors`` or a ``torch.save`` file (read with ``weights_only=True``).
        model: None (use the stored config, or infer it from the shapes), a variant name
            (checked against the stored config), or a Detector to load into.

    Raises:
        UnsafeFileError: a pickle that refers to anything beyond tensors and containers.
        ValueError: not a yolokit file, or tensors that do not fit (the message names the file).
    """
    path, source = Path(path), str(path)
    if path.suffix == ".safetensors" or is_safetensors_file(path):
        return from_safetensors_file(path, model=model)
    return from_torch_object(load_pickled(path), model=model, source=source,
                             what="neither a yolokit file nor a state dict of tensors (an Ultralytics checkpoint? "
                                  "yolokit.load and load_ultralytics read those)")


def from_torch_object(obj: Any, *, model: str | Detector | None, source: str, what: str,
                      other: Callable[[Any], Detector | None] | None = None) -> Detector:
    """A ready Detector from what a torch file held: a yolokit file, else what ``other``
    makes of it (None: not its kind), else a plain state dict in yolokit's naming.

    Raises:
        ValueError: none of those; the message is ``f"{source}: {what}"``.
    """
    if is_native(obj):
        return from_native_object(obj, model=model, source=source)
    if is_training_checkpoint(obj):     # its EMA weights (what the run validated and best.pt holds), as the reference's
        ema = obj.get("ema")
        state = ema["module"] if isinstance(ema, Mapping) and isinstance(ema.get("module"), Mapping) else obj["model"]
        return attach_names(from_contents(state, obj["model_config"], model=model, source=source), obj.get("names"))
    found = other(obj) if other is not None else None
    if found is not None:
        return found
    state = state_dict_in(obj)
    if state is None:
        raise ValueError(f"{source}: {what}")
    return build_from_state_dict(state, model=model, source=source)


def is_safetensors_file(path: str | Path) -> bool:
    """A safetensors file starts with a little-endian u64 header length, then '{'."""
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) < 9 or head[8:9] != b"{":
        return False
    return int.from_bytes(head[:8], "little") <= os.path.getsize(path) - 8
