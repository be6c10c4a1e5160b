"""How the loader's workers start, and how a dataset defined in a notebook reaches them.

``fork`` copies the training process: a worker has everything its parent has. ``spawn`` and
``forkserver`` (the default on macOS, and on Linux from Python 3.14) start a fresh interpreter and
send it the dataset, the collate function and the worker init function by pickle, which names each
class and function by its module. One defined in a notebook cell (or a REPL, ``python -c``) lives in
a ``__main__`` that a fresh interpreter cannot import: its workers would die at start.

:func:`worker_context` decides when the workers start, before any of them does:

- ``multiprocessing_context`` given: that method. Other than fork, the objects are test-pickled first;
  what refers to an interactive ``__main__`` is sent by value (cloudpickle), what cannot be sent at
  all fails in one line.
- none given and the platform's default is fork (Linux before Python 3.14): fork, as PyTorch does.
- none given otherwise: the objects are test-pickled. Everything importable: the platform's default.
  Something of an interactive ``__main__``, or something that cannot be pickled: fork on Linux while CUDA is not
  initialized in this process (nothing to send, and the workers share what the parent built), else
  the objects by value with cloudpickle where it is installed (never fork once CUDA is initialized:
  a run on CUDA keeps a start method that does not copy a CUDA process), else one line naming the
  class and the three fixes.

The test-pickle costs next to nothing: it writes nowhere, skips tensors and numeric arrays (their bytes
say nothing about whether they can be sent), and pickles as to a starting process (``get_spawning_popen``),
so shared memory (``SharedArray``, the RAM image cache, the batch buffers) is named by file
descriptor, never copied, and no descriptor is duplicated.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import pickle
import sys
import types
from collections import ChainMap
from collections.abc import Iterator, Sequence
from multiprocessing.context import BaseContext, get_spawning_popen, set_spawning_popen
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch

FIXES = 'define it in a .py file and import it, use fork (multiprocessing_context="fork"), or workers=0'


def worker_context(requested: str | BaseContext | None, objects: Sequence[Any]) -> str | BaseContext | None:
    """The ``multiprocessing_context`` for a loader's workers (see the module docstring).

    Args:
        requested: what the loader was given: a start method's name, a context, or None (the platform's).
        objects: what each worker receives: the dataset first, then the collate and worker init functions.

    Returns:
        what ``DataLoader.multiprocessing_context`` takes: ``requested``, ``"fork"``, or a context whose
        workers get ``objects`` by value.

    Raises:
        pickle.PicklingError: (one line) ``objects`` cannot reach workers started other than by fork.
    """
    method = requested.get_start_method() if isinstance(requested, BaseContext) else requested
    method = method or default_start_method()
    if method == "fork":
        return requested
    problem = _rehearse(objects, by_value=False)
    if problem is None:
        return requested
    if requested is None and fork_is_safe():
        return "fork"
    try:
        import cloudpickle  # noqa: F401
    except ImportError:
        problem += ", and cloudpickle (which would send it by value) is not installed"
    else:
        problem = _rehearse(objects, by_value=True)
        if problem is None:
            return ByValueContext(method)
    raise pickle.PicklingError(f"{type(objects[0]).__name__} cannot be sent to the loader's {method} workers: "
                               f"{problem}; {FIXES}")


def default_start_method() -> str:
    """The start method processes get by default here: the one set, else the platform's (fixing neither)."""
    return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]


def fork_is_safe() -> bool:
    """Whether this process may fork workers on its own account: on Linux, with CUDA not initialized."""
    return sys.platform.startswith("linux") and not torch.cuda.is_initialized()


def main_is_importable() -> bool:
    """Whether a fresh interpreter can import this ``__main__``: a script or ``-m``, not a notebook, a REPL,
    ``python -c`` or ``python -`` (spawn runs the script again, or imports the module, as ``__mp_main__``)."""
    main = sys.modules.get("__main__")
    return os.path.isfile(getattr(main, "__file__", None) or "") or \
        getattr(getattr(main, "__spec__", None), "name", None) is not None


class ByValueContext(BaseContext):
    """A start method whose processes get their target and arguments by value (cloudpickle).

    Each process's target and arguments are pickled as it starts, as one piece: classes and functions of an
    interactive ``__main__`` travel as code, everything else as a start pickles it (queues, shared memory
    and file descriptors go to the process, tensors to shared memory).

    Args:
        method: "spawn" or "forkserver".
    """

    def __init__(self, method: str) -> None:
        self._name, self._base = method, multiprocessing.get_context(method)

    def Process(self, group: None = None, target: Any = None, name: str | None = None, args: tuple = (),  # noqa: N802
                kwargs: dict | None = None, *, daemon: bool | None = None) -> Any:   # (multiprocessing's signature)
        return self._base.Process(group, _call, name, (_ByValue((target, args, kwargs or {})),), daemon=daemon)


def _call(call: tuple) -> Any:
    target, args, kwargs = call
    return target(*args, **kwargs)


class _ByValue:
    """``obj`` pickled with cloudpickle inside the ordinary pickle of a starting process."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __reduce__(self) -> tuple:
        buffer = io.BytesIO()
        _by_value_pickler(buffer).dump(self.obj)
        return pickle.loads, (buffer.getvalue(),)


def _by_value_pickler(file: Any, rehearsal: bool = False) -> pickle.Pickler:
    """cloudpickle's pickler with what a start adds (multiprocessing's and PyTorch's reductions)."""
    import cloudpickle

    class Pickler(cloudpickle.Pickler):    # the table is read as a pickler is made: a class attribute
        dispatch_table = ChainMap(cloudpickle.Pickler.dispatch_table, ForkingPickler(io.BytesIO()).dispatch_table)

        def reducer_override(self, obj: Any) -> Any:
            return (_skipped(obj) if rehearsal else None) or super().reducer_override(obj)

    return Pickler(file)


class _ReferencePickler(ForkingPickler):
    """A start's pickler that notes the first class or function of an interactive ``__main__`` it names."""

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self.local: str | None = None

    def reducer_override(self, obj: Any) -> Any:
        if (isinstance(obj, (type, types.FunctionType)) and obj.__module__ == "__main__" and self.local is None
                and not main_is_importable()):
            self.local = obj.__qualname__
        return _skipped(obj) or NotImplemented


def _skipped(obj: Any) -> tuple | None:
    """A stand-in for the bytes of a tensor or a numeric array in a test-pickle, else None."""
    if isinstance(obj, torch.Tensor) or (isinstance(obj, np.ndarray) and not obj.dtype.hasobject):
        return tuple, ()
    return None


class _Nowhere:
    """A file that keeps nothing (a test-pickle's bytes are not needed)."""

    def write(self, data: Any) -> int:
        return len(data)


class _Rehearsal:
    """Stands for a starting process in a test-pickle: a file descriptor is named, not duplicated."""

    @staticmethod
    def duplicate_for_child(fd: int) -> int:
        return fd

    @staticmethod
    def DupFd(fd: int) -> None:  # noqa: N802 (multiprocessing's name)
        return None


@contextlib.contextmanager
def _as_if_starting() -> Iterator[None]:
    previous = get_spawning_popen()
    set_spawning_popen(_Rehearsal())
    try:
        yield
    finally:
        set_spawning_popen(previous)


def _rehearse(objects: Sequence[Any], *, by_value: bool) -> str | None:
    """What stops ``objects`` from reaching a started process (None: nothing), in a few words."""
    pickler = _by_value_pickler(_Nowhere(), rehearsal=True) if by_value else _ReferencePickler(_Nowhere())
    try:
        with _as_if_starting():
            pickler.dump(tuple(objects))
    except Exception as exc:
        lines = str(exc).splitlines() or [""]
        return f"{type(exc).__name__}: {lines[0]}"
    if not by_value and pickler.local is not None:
        return f"{pickler.local} is defined in a notebook or an interactive session (its __main__)"
    return None
