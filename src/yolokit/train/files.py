"""Writing a run's files so that a failure loses nothing and says so in one line.

:func:`atomic_save` writes a checkpoint to a temporary file in the target folder, flushed
and fsynced, then renames it over the target: a crash or a full disk at any point leaves
either the old file or the new one, never half of one. :func:`write_text` does the same
for a text file, and appends (``results.csv``) report the same way. Any failure is a
:class:`SaveError` that names the file, what it needed and what was free.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch


class SaveError(OSError):
    """A checkpoint or run file could not be written; what was on disk before is untouched.

    Attributes:
        path: The file.
        needed: Bytes it needed (None when unknown).
        free: Bytes free on its filesystem after the attempt.
        advice: What to do now (the trainer says which checkpoint is intact and how to resume).
    """

    advice = ""

    def __init__(self, path: str | Path, needed: int | None, cause: BaseException) -> None:
        self.path, self.needed = Path(path), needed
        self.free = _free_bytes(self.path.parent)
        reason = getattr(cause, "strerror", None) or str(cause) or type(cause).__name__
        space = f"needs {_size(needed)}, " if needed is not None else ""
        super().__init__(getattr(cause, "errno", None) or errno.EIO,
                         f"cannot write {self.path}: {reason} ({space}{_size(self.free)} free)")

    def __str__(self) -> str:
        return f"{self.strerror}; {self.advice}" if self.advice else (self.strerror or "")

    def __reduce__(self) -> tuple[Any, ...]:   # picklable (it crosses from a rank to its launcher)
        return _rebuild, (str(self.path), self.needed, self.free, self.errno, self.strerror, self.advice)


def _rebuild(path: str, needed: int | None, free: int, code: int, message: str, advice: str) -> SaveError:
    exc = SaveError.__new__(SaveError)
    OSError.__init__(exc, code, message)
    exc.path, exc.needed, exc.free, exc.advice = Path(path), needed, free, advice
    return exc


def _free_bytes(folder: Path) -> int:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return 0


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    if n < 2**10:
        return f"{n} B"
    return f"{n / 2**20:.1f} MB" if n >= 2**20 else f"{n / 2**10:.1f} KB"


class _CountingFile:
    """A write-only file for ``torch.save`` that keeps counting after a failed write.

    After the first error nothing more is written, but the bytes the save hands over are
    still counted, so the caller learns how much the whole file needed (``size``).
    """

    def __init__(self, fd: int) -> None:
        self.file = os.fdopen(fd, "wb", buffering=0)
        self.size, self.error = 0, None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if self.error is None:
            try:
                while view:                          # a raw write may be short: until all is out
                    view = view[self.file.write(view):]
            except OSError as exc:
                self.error = exc
        self.size += n
        return n

    def flush(self) -> None:
        pass


def atomic_save(obj: Any, path: str | Path) -> Path:
    """``torch.save`` to ``path`` atomically (temporary file, fsync, rename, fsync folder).

    Raises:
        SaveError: the file could not be written (a full disk, no permission); ``path`` is as it was.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise SaveError(path, None, exc) from exc
    out = _CountingFile(fd)
    try:
        with out.file:
            torch.save(obj, out)
            if out.error is None:
                os.fsync(out.file.fileno())
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise SaveError(path, out.size, exc) from exc
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if out.error is not None:
        Path(tmp).unlink(missing_ok=True)
        raise SaveError(path, out.size, out.error) from out.error
    _replace(tmp, path)
    return path


def write_text(path: str | Path, text: str, *, append: bool = False) -> Path:
    """Writes (atomically) or appends ``text``; a failure is a :class:`SaveError` (an append may leave a
    partial last line, which readers of the file skip)."""
    path = Path(path)
    data = text.encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if append:
            with path.open("ab") as f:
                f.write(data)
            return path
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise SaveError(path, len(data), exc) from exc
    _replace(tmp, path)
    return path


def _replace(tmp: str, path: Path) -> None:
    os.replace(tmp, path)
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:  # some platforms cannot open folders
        return
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
