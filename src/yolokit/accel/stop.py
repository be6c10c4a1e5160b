"""Stopping on a signal: Ctrl-C and SIGTERM end a run at a step boundary, on every rank at once.

:class:`Interrupted` is the ``KeyboardInterrupt`` a stop raises (it carries the signal and
the exit code a shell expects); :class:`GracefulStop` installs the handlers around a
training loop; :func:`raise_interrupted` is a handler that makes SIGTERM act like Ctrl-C.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from yolokit.accel.distributed import host_group, is_initialized


class Interrupted(KeyboardInterrupt):
    """A stop asked for by a signal (a ``KeyboardInterrupt``, so code that handles Ctrl-C handles it).

    Attributes:
        signum: The signal, ``SIGINT`` (Ctrl-C) or ``SIGTERM``.
        exit_code: What the process should exit with: 128 + ``signum``, as a shell reports a
            process a signal ended (130 for Ctrl-C, 143 for SIGTERM).
        reported: Whether the line that says where the run stopped was already written.
    """

    def __init__(self, signum: int = signal.SIGINT, message: str | None = None) -> None:
        self.signum = int(signum)
        self.reported = False
        super().__init__(message or f"{signal.Signals(self.signum).name} received")

    @classmethod
    def of(cls, exc: KeyboardInterrupt) -> Interrupted:
        """``exc`` itself, or for a plain ``KeyboardInterrupt`` (Python's own Ctrl-C) a SIGINT stop."""
        return exc if isinstance(exc, cls) else cls(signal.SIGINT)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def raise_interrupted(signum: int, frame: Any = None) -> None:
    """A signal handler that raises :class:`Interrupted` (``signal.signal(signal.SIGTERM,
    raise_interrupted)`` makes SIGTERM end a program the way Ctrl-C does)."""
    raise Interrupted(signum)


class GracefulStop:
    """SIGINT (Ctrl-C) and SIGTERM (torchrun's shutdown) as a stop at an optimizer step boundary.

    One process: a signal raises :class:`Interrupted` (a ``KeyboardInterrupt``) at once, as
    Python does for Ctrl-C, except inside :meth:`deferred` sections (an optimizer step and its
    bookkeeping), where it is raised when the section ends; the caller drops the step in
    progress and saves.

    Several processes: a signal only records the request (raising at once would leave the
    other ranks waiting in a collective). Every rank calls :meth:`requested` at every step
    boundary; it max-reduces the ranks' signal numbers over a gloo group (no accelerator
    synchronisation: a separate gloo group under NCCL) without waiting: the exchange started
    at boundary k is read at boundary k + 1, so all ranks answer the same, one step after
    the signal.

    A second signal is a hard stop: it raises at once, wherever the process is.

    A signal is never lost: Python drops an exception raised where it cannot propagate (an
    at-fork hook while loader workers start, a finaliser), so the first signal is also kept in
    ``received`` and :meth:`requested` answers True at the next boundary; such a dropped
    :class:`Interrupted` prints no traceback.

    Use as a context manager around training: handlers are installed on entry (from the
    main thread only) and the previous ones put back on exit.
    """

    def __init__(self) -> None:
        self.received: int | None = None      # the first signal number caught (or agreed on)
        self.agreed: tuple[int, ...] = ()     # max over ranks of the values last decided by requested()
        self._depth, self._pending, self._many, self._caught = 0, False, False, 0
        self._previous: dict[int, Any] = {}
        self._hook: Any = sys.unraisablehook
        self._group: Any = None
        self._work: Any = None
        self._flag = torch.zeros(1, dtype=torch.int32)

    def __enter__(self) -> GracefulStop:
        self._many = is_initialized() and dist.get_world_size() > 1
        if self._many:
            self._group = host_group()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        self._hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        return self

    def __exit__(self, kind: Any, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        sys.unraisablehook = self._hook
        if self._work is not None and kind is None:   # finished normally: every rank started it
            self._work.wait()
        self._work = None

    def _unraisable(self, info: Any) -> None:
        if not isinstance(info.exc_value, Interrupted):   # ours is kept in `received`, acted on later
            self._hook(info)

    def _handle(self, signum: int, frame: Any) -> None:
        self._caught += 1
        if self.received is None:
            self.received = signum
        if self._caught > 1:                          # the second signal: stop now
            raise Interrupted(signum, f"{signal.Signals(signum).name} received again: stopping at once")
        if self._many:
            return
        if self._depth:
            self._pending = True
            return
        raise Interrupted(signum)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A section a one-process signal does not interrupt (it is raised at the end)."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if self._pending and not self._depth:
            self._pending = False
            raise Interrupted(self.received or signal.SIGINT)

    def requested(self, *values: int) -> bool:
        """Whether every rank stops here (several processes; call at every step boundary on every rank).

        When it answers True, ``received`` holds the signal (the largest number any rank got).
        One process: whether a signal came whose exception was dropped (see the class).

        Args:
            values: Other numbers the ranks decide on together in the same exchange (the
                trainer's count of non-finite losses in a row, and of optimizer steps retried
                after out-of-memory); as many on every rank at every call. Their max over
                ranks lands in ``agreed``: with several processes one boundary later (the
                values proposed at boundary k are decided at k + 1), with one at once.
        """
        if not self._many:
            self.agreed = tuple(int(v) for v in values)
            return self.received is not None
        decided = [0] * (1 + len(values))
        if self._work is not None:
            self._work.wait()
            decided = self._flag.tolist()               # a CPU tensor: no device read
        self._flag = torch.tensor([self.received or 0, *values], dtype=torch.int64)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        if decided[0]:
            self.received = int(decided[0])
        self.agreed = tuple(int(v) for v in decided[1:])
        return bool(decided[0])
