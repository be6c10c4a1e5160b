"""Reading pickled torch files without running code from them.

Every pickle yolokit reads goes through ``load_pickled``: ``torch.load(weights_only=True)``,
whose unpickler only builds tensors and plain containers, plus an allowlist of the
module classes Ultralytics pickles, each mapped to an inert ``StandIn`` that only keeps
the state it is given. Any other global in the file (``os.system``, an unknown class)
is refused with ``UnsafeFileError`` before anything is called.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

# The globals Ultralytics detection and instance segmentation checkpoints pickle (ultralytics 8.x): the
# DetectionModel or SegmentationModel object and the layers of YOLOv8 (P2, P6), YOLO11, YOLO26, YOLOv5u and
# YOLOv3u. Each becomes a StandIn;
# nothing of theirs runs.
ULTRALYTICS_GLOBALS: tuple[str, ...] = (
    "torch.nn.modules.activation.SiLU",
    "torch.nn.modules.batchnorm.BatchNorm2d",
    "torch.nn.modules.container.ModuleList",
    "torch.nn.modules.container.Sequential",
    "torch.nn.modules.conv.Conv2d",
    "torch.nn.modules.conv.ConvTranspose2d",
    "torch.nn.modules.linear.Identity",
    "torch.nn.modules.padding.ZeroPad2d",
    "torch.nn.modules.pooling.MaxPool2d",
    "torch.nn.modules.upsampling.Upsample",
    "ultralytics.nn.modules.block.Attention",
    "ultralytics.nn.modules.block.Bottleneck",
    "ultralytics.nn.modules.block.C2",
    "ultralytics.nn.modules.block.C2PSA",
    "ultralytics.nn.modules.block.C2f",
    "ultralytics.nn.modules.block.C3",
    "ultralytics.nn.modules.block.C3k",
    "ultralytics.nn.modules.block.C3k2",
    "ultralytics.nn.modules.block.DFL",
    "ultralytics.nn.modules.block.PSABlock",
    "ultralytics.nn.modules.block.Proto",
    "ultralytics.nn.modules.block.Proto26",
    "ultralytics.nn.modules.block.SPP",
    "ultralytics.nn.modules.block.SPPF",
    "ultralytics.nn.modules.conv.Concat",
    "ultralytics.nn.modules.conv.Conv",
    "ultralytics.nn.modules.conv.DWConv",
    "ultralytics.nn.modules.head.Detect",
    "ultralytics.nn.modules.head.Segment",
    "ultralytics.nn.modules.head.Segment26",
    "ultralytics.nn.tasks.DetectionModel",
    "ultralytics.nn.tasks.SegmentationModel",
    "ultralytics.utils.IterableSimpleNamespace",
    # the same classes under the paths of older 8.0.x releases
    "ultralytics.nn.modules.Bottleneck",
    "ultralytics.nn.modules.C2",
    "ultralytics.nn.modules.C2f",
    "ultralytics.nn.modules.C3",
    "ultralytics.nn.modules.DFL",
    "ultralytics.nn.modules.SPP",
    "ultralytics.nn.modules.SPPF",
    "ultralytics.nn.modules.Concat",
    "ultralytics.nn.modules.Conv",
    "ultralytics.nn.modules.DWConv",
    "ultralytics.nn.modules.Detect",
    "ultralytics.nn.modules.Proto",
    "ultralytics.nn.modules.Segment",
    "ultralytics.yolo.utils.IterableSimpleNamespace",
)


class UnsafeFileError(ValueError):
    """A file asked for something yolokit will not do while loading (import or call a global)."""


class StandIn:
    """Inert stand-in for a pickled class: stores the state it is given, runs nothing.

    ``global_name`` is the dotted name the file asked for, e.g.
    ``"ultralytics.nn.modules.conv.Conv"``.
    """

    global_name = "?"

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):  # (dict, slots)
            state = {**(state[0] if isinstance(state[0], dict) else {}), **state[1]}
        if isinstance(state, dict):  # dunder names could shadow methods: never taken from a file
            self.__dict__.update({k: v for k, v in state.items() if isinstance(k, str) and not k.startswith("__")})
        else:
            self.__dict__["_state"] = state

    def __repr__(self) -> str:
        return f"StandIn({self.global_name})"


def _stand_ins(names: tuple[str, ...]) -> list[tuple[type, str]]:
    """One StandIn subclass per allowed global, as ``torch.serialization.safe_globals`` takes them."""
    return [(type(name.rsplit(".", 1)[-1], (StandIn,), {"global_name": name}), name) for name in names]


def pickle_globals(path: str | Path) -> list[str]:
    """The globals (``module.name``) a torch file or plain pickle refers to, read without unpickling.

    Best effort (``pickletools`` over the opcodes); used to say what a refused file asked for.
    """
    path = Path(path)
    found: list[str] = []
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                streams = [archive.read(n) for n in archive.namelist() if n.endswith(".pkl")]
        else:
            streams = [path.read_bytes()]
    except (OSError, zipfile.BadZipFile):
        return found
    for data in streams:
        stream = io.BytesIO(data)
        for _ in range(8):  # legacy torch files are several pickles in a row, then raw bytes
            try:
                found += _globals_of_one_pickle(stream)
            except Exception:  # noqa: BLE001 - raw storage bytes after the pickles
                break
    return list(dict.fromkeys(found))


def _globals_of_one_pickle(stream: io.BytesIO) -> list[str]:
    names, strings, memo = [], [], {}
    for op, arg, _ in pickletools.genops(stream):
        if op.name == "GLOBAL":
            names.append(str(arg).replace(" ", ".").replace("__builtin__.", "builtins.", 1))
        elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
            names.append(f"{strings[-2]}.{strings[-1]}")
        elif isinstance(arg, str) and "UNICODE" in op.name:
            strings.append(arg)
        elif op.name in ("BINPUT", "LONG_BINPUT", "PUT") and strings:
            memo[arg] = strings[-1]
        elif op.name == "MEMOIZE" and strings:
            memo[len(memo)] = strings[-1]
        elif op.name in ("BINGET", "LONG_BINGET", "GET") and arg in memo:
            strings.append(memo[arg])
    return names


def load_pickled(path: str | Path, *, allow: tuple[str, ...] = ULTRALYTICS_GLOBALS) -> Any:
    """Unpickles a torch file (zip or legacy) with ``torch.load(weights_only=True)``.

    Args:
        path: file written by ``torch.save`` (or a plain pickle).
        allow: dotted global names mapped to inert ``StandIn`` objects; tensors, dicts,
            lists and the other containers torch's safe unpickler knows are always allowed.

    Returns:
        The unpickled object on the CPU; module objects come back as ``StandIn``.

    Raises:
        UnsafeFileError: the file refers to any other global (a function to call, an
            unknown class); nothing from it has run.
        ValueError: the file is not a readable torch file.
    """
    path = Path(path)
    with open(path, "rb") as f:
        first = f.read(1)
    if first != b"\x80" and not zipfile.is_zipfile(path):  # torch.save writes a zip or a protocol-2 pickle
        raise ValueError(f"{path}: not a torch file (neither a zip archive nor a pickle)")
    try:
        with torch.serialization.safe_globals(_stand_ins(allow)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        unexpected = [g for g in pickle_globals(path) if g not in allow and not _torch_allows(g)]
        if unexpected:
            reason = f"it refers to {', '.join(unexpected)}, which yolokit does not allow"
        else:
            lines = [s for s in str(exc).splitlines() if s.strip() and "weights_only" not in s
                     and "documentation" not in s]
            reason = f"the safe unpickler rejected it ({lines[0] if lines else type(exc).__name__})"
        raise UnsafeFileError(
            f"{path}: refused to load: {reason}. Loading never runs code from a file: only tensors, "
            "plain containers and Ultralytics' detection model classes are read."
        ) from None
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged or odd file: say which, whatever broke
        raise ValueError(f"{path}: not a readable torch file ({type(exc).__name__}: {exc})") from exc


def _torch_allows(name: str) -> bool:
    """Whether torch's safe unpickler accepts ``name`` on its own (tensor rebuilds, storages)."""
    try:
        from torch._weights_only_unpickler import _get_allowed_globals
    except ImportError:  # private module moved: fall back to the names torch always owns
        return name.startswith(("torch._utils.", "torch.serialization.", "collections.OrderedDict"))
    return name in _get_allowed_globals()


def module_state_dict(obj: Any, prefix: str = "", *, _ancestors: frozenset[int] = frozenset()) -> dict[str, Tensor]:
    """The state dict of a pickled module tree, read from its stored attributes.

    Works on ``StandIn`` objects (and real modules): parameters, then persistent buffers,
    then children, depth first, as ``nn.Module.state_dict`` orders them (a child shared by
    several parents, like Ultralytics' one SiLU, is visited under each). Anything that is
    not a tensor is skipped.

    Examples:
        >>> sd = module_state_dict(load_pickled("yolov8n.pt")["model"])
        >>> sd["model.0.conv.weight"].shape
        torch.Size([16, 3, 3, 3])

    Raises:
        ValueError: a module contains itself (directly or further down).
    """
    if id(obj) in _ancestors:
        raise ValueError(f"module tree loops back on itself at {prefix or 'the root'}")
    ancestors = _ancestors | {id(obj)}
    state = vars(obj)
    out: dict[str, Tensor] = {}
    for name, value in _items(state.get("_parameters")):
        if isinstance(value, Tensor):
            out[prefix + name] = value.detach()
    skip = state.get("_non_persistent_buffers_set")
    skip = skip if isinstance(skip, set) else set()
    for name, value in _items(state.get("_buffers")):
        if isinstance(value, Tensor) and name not in skip:
            out[prefix + name] = value.detach()
    for name, child in _items(state.get("_modules")):
        if hasattr(child, "__dict__"):
            out.update(module_state_dict(child, f"{prefix}{name}.", _ancestors=ancestors))
    return out


def _items(mapping: Any) -> list[tuple[str, Any]]:
    return [(str(k), v) for k, v in mapping.items()] if isinstance(mapping, dict) else []
