"""Stopping on a signal: Ctrl-C and SIGTERM end a run at a step boundary, on every rank at once.

:class:`Interrupted` is the ``KeyboardInterrupt`` a stop raises (it carries the signal and
the exit code a shell expects); :class:`GracefulStop` installs the handlers around a
training loop; :func:`deferred_signals` holds a signal back until a cleanup is done;
:func:`raise_interrupted` is a handler that makes SIGTERM act like Ctrl-C.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any


class Interrupted(KeyboardInterrupt):
    """A stop asked for by a signal (a ``KeyboardInterrupt``, so code that handles Ctrl-C handles it).

    In a Jupyter notebook it shows as its one line, not as a traceback (IPython's
    ``_render_traceback_``): the cell that was interrupted ends with where it stopped.

    Attributes:
        signum: The signal, ``SIGINT`` (Ctrl-C) or ``SIGTERM``.
        exit_code: What the process should exit with: 128 + ``signum``, as a shell reports a
            process a signal ended (130 for Ctrl-C, 143 for SIGTERM).
        reported: Whether the line that says where the run stopped was already written.
        run_dir: A training run's folder, once its ``last.pt`` holds ``steps`` (None otherwise).
        steps: The optimizer steps that checkpoint holds.
    """

    def __init__(self, signum: int = signal.SIGINT, message: str | None = None) -> None:
        self.signum = int(signum)
        self.reported = False
        self.run_dir: str | None = None
        self.steps: int | None = None
        super().__init__(message or f"{signal.Signals(self.signum).name} received")

    def _render_traceback_(self) -> list[str]:
        """What IPython shows for it: one line (the frames it came through say nothing a user can act on)."""
        return [f"{type(self).__name__}: {self}"]

    @classmethod
    def of(cls, exc: BaseException) -> Interrupted:
        """``exc`` itself, or for a plain ``KeyboardInterrupt`` (Python's own Ctrl-C) a SIGINT stop. A
        ``SystemError`` that a stop raised inside a C function calling back into Python (``os.fspath`` of
        ``np.fromfile``) becomes that stop; any other exception is raised again."""
        if isinstance(exc, SystemError) and isinstance(exc.__context__, KeyboardInterrupt):
            exc = exc.__context__
        if not isinstance(exc, KeyboardInterrupt):
            raise exc
        return exc if isinstance(exc, cls) else cls(signal.SIGINT)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@contextlib.contextmanager
def deferred_signals() -> Iterator[None]:
    """A section that SIGINT and SIGTERM do not cut short: a cleanup that must finish (loaders closed,
    callbacks told). A signal that arrives meanwhile is raised as :class:`Interrupted` when the section
    ends, unless an exception already leaves it (a stop being handled: the signal asked for what is
    happening). Handlers can only be changed from the main thread; elsewhere the section is plain."""
    received: list[int] = []
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda signum, frame: received.append(signum))
    ok = False
    try:
        yield
        ok = True
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)   # None: set outside Python
    if ok and received:
        raise Interrupted(received[0])


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

    Several processes (``several=True``): a signal only records the request in ``received``
    (raising at once would leave the other ranks waiting in a collective). The ranks then
    decide together to stop at a step boundary: the trainer exchanges ``received`` in its
    per-step :class:`yolokit.accel.agreement.RankExchange`.

    A second signal is a hard stop: it raises at once, wherever the process is.

    A signal is never lost: Python drops an exception raised where it cannot propagate (an
    at-fork hook while loader workers start, a finaliser), so the first signal is also kept in
    ``received``, for the caller to act on at the next boundary; such a dropped
    :class:`Interrupted` prints no traceback.

    Use as a context manager around training: handlers are installed on entry (from the
    main thread only) and the previous ones put back on exit.

    Args:
        several: Whether this is one of several processes that must stop together.
    """

    def __init__(self, *, several: bool = False) -> None:
        self.received: int | None = None      # the first signal number caught
        self.several = several
        self._depth, self._pending, self._caught = 0, False, 0
        self._previous: dict[int, Any] = {}
        self._hook: Any = sys.unraisablehook

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        self._hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        sys.unraisablehook = self._hook

    def _unraisable(self, info: Any) -> None:
        if not isinstance(info.exc_value, Interrupted):   # ours is kept in `received`, acted on later
            self._hook(info)

    def _handle(self, signum: int, frame: Any) -> None:
        self._caught += 1
        if self.received is None:
            self.received = signum
        if self._caught > 1:                          # the second signal: stop now
            raise Interrupted(signum, f"{signal.Signals(signum).name} received again: stopping at once")
        if self.several:
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
