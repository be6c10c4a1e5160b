"""Start one process per device on this machine, or run in place under torchrun.

The launcher only starts processes: each one gets torchrun's environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``
on a free port) and calls ``fn(*args)``; ``fn`` itself calls
:func:`yolokit.accel.distributed.setup`. So the same ``fn`` runs unchanged under
``torchrun`` (several machines go through torchrun), where :func:`launch` simply calls
it once in the current process.

Example::

    def train(epochs):
        device = distributed.setup()
        ...
        distributed.teardown()
        return final_loss

    losses = launch(train, 2, 10)        # [loss of rank 0, loss of rank 1]

How the processes start: by ``spawn`` (a fresh interpreter, which imports ``fn`` and unpickles the
arguments) when it can import everything they name, which a function defined in a notebook cell (or
a REPL) is not: ``fn`` and the arguments then go by ``fork``, which copies this process and pickles
nothing, as notebook launchers do. A forked process cannot use CUDA initialized in its parent, so
fork is refused once CUDA is initialized here. ``start_method`` chooses either.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as tmp

from yolokit.accel import distributed
from yolokit.accel.stop import Interrupted, raise_interrupted

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


class LaunchError(RuntimeError):
    """A launched process raised or died; the others were terminated.

    Attributes:
        rank: Local rank of the first failure: the first rank found dead from a signal
            (SIGKILL, the OOM killer...) before any rank that exited with an error (a rank
            whose peer vanished fails in its next collective, a moment later).
        ranks: Local ranks whose function raised (their tracebacks are in the message).
        errors: What those ranks raised, by rank, where the exception could be sent back
            (a caller can report a known failure in its own words).
    """

    def __init__(self, message: str, rank: int, ranks: list[int],
                 errors: dict[int, BaseException] | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.ranks = ranks
        self.errors = errors or {}


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or another launcher setting its env)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or all(v in os.environ for v in _TORCHRUN_VARS)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_STOPS = {signal.SIGINT, signal.SIGTERM}   # what launch() passes on to the ranks


def _entry(local_rank: int, call: bytes | tuple, nprocs: int, port: int, results: Any) -> None:
    # A session of its own, as torchrun gives its ranks: Ctrl-C in the terminal reaches the launcher
    # alone, which passes each signal on once (the second one it sends is a hard stop). PyTorch's
    # wrapper makes the launcher's death a SIGINT here.
    os.setsid()
    signal.signal(signal.SIGTERM, raise_interrupted)   # a stop before training installs its own
    signal.signal(signal.SIGINT, signal.default_int_handler)   # forked: not the launcher's forwarding handler
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)   # held by launch() while it started us: they arrive now
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if "OMP_NUM_THREADS" not in os.environ:  # do not oversubscribe the CPU cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // nprocs))
    try:
        fn, args = pickle.loads(call) if isinstance(call, bytes) else call   # a failure here is reported too
        result = fn(*args)
    except KeyboardInterrupt as exc:     # a signal: the rank stopped where it could; no traceback
        failure = exc.__context__        # unless it cut short the handling of a failure: that is what counts
        if failure is not None and not isinstance(failure, KeyboardInterrupt):
            results.put((local_rank, "error", ("".join(traceback.format_exception(failure)), _sendable(failure))))
            raise failure from None
        stop = Interrupted.of(exc)
        results.put((local_rank, "interrupted", (stop.signum, stop.reported, stop.run_dir, stop.steps)))
        return
    except BaseException as exc:
        results.put((local_rank, "error", (traceback.format_exc(), _sendable(exc))))
        raise  # exit at once; the parent terminates the other processes
    distributed.teardown()
    results.put((local_rank, "ok", result))


def launch(fn: Callable[..., Any], nprocs: int, *args: Any, timeout: float | None = None,
           start_method: str | None = None) -> list[Any]:
    """Run ``fn(*args)`` in ``nprocs`` processes on this machine and collect the results.

    Under torchrun, or with ``nprocs <= 1``, ``fn`` runs once in this process. When a
    process raises or dies, the remaining ones are terminated and :class:`LaunchError`
    is raised here, with each failed rank's traceback, so no rank is left waiting in a collective.

    Signals: each process runs in a session of its own, as under torchrun. Ctrl-C or SIGTERM
    sent to this process is passed on to every process once (a training loop stops them at
    the same optimizer step, see :class:`yolokit.accel.stop.GracefulStop`); when they
    have ended, :class:`yolokit.accel.stop.Interrupted` is raised here. A second
    signal kills them at once, with their loader workers.

    Args:
        fn: The function each process runs; it calls ``distributed.setup()``. Defined in a file, or in a
            notebook cell (see the module docstring).
        nprocs: Number of processes, usually one per GPU.
        *args: Arguments passed to every process: pickled once here (by value: tensors are copied)
            unless the processes are forked.
        timeout: Seconds after which all processes are terminated and TimeoutError is
            raised; ``None`` waits for ever.
        start_method: "spawn", "forkserver" or "fork"; None: "fork" when a fresh interpreter could not
            import ``fn`` or what the arguments name (a notebook's), else "spawn".

    Returns:
        The return values of ``fn`` by local rank (one value when run in place).

    Raises:
        RuntimeError: fork is needed, and CUDA is already initialized in this process.
        pickle.PicklingError: ``fn`` or the arguments cannot be sent to spawned processes.
    """
    if under_torchrun() or nprocs <= 1:
        return [fn(*args)]
    method, call = _start(fn, args, start_method)
    results = multiprocessing.get_context(method).SimpleQueue()
    collected: dict[int, Any] = {}
    errors: dict[int, str] = {}
    stopped: dict[int, tuple[int, bool]] = {}
    signals: list[int] = []
    ranks: list[Any] = []     # the processes, once all are started
    missed: list[int] = []    # signals that came before them

    def drain() -> None:
        while not results.empty():
            r, status, value = results.get()
            {"ok": collected, "error": errors, "interrupted": stopped}[status][r] = value

    def pass_on(signum: int, count: int) -> None:
        for p in ranks:
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    if count == 1:
                        os.kill(p.pid, signum)
                    else:                        # the second signal: now, loader workers included
                        os.killpg(p.pid, signal.SIGKILL)

    def forward(signum: int, frame: Any) -> None:
        signals.append(signum)
        if ranks:
            pass_on(signum, len(signals))
        else:
            missed.append(signum)

    # Installed, and the stop signals held, before the ranks start: a Ctrl-C while they are forked arrives
    # once they run (the default handler's KeyboardInterrupt, raised inside fork's hooks, was lost there),
    # and the ranks hold them until their own handlers are in place (_entry).
    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, forward) for sig in _STOPS} if main else {}
    deadline = None if timeout is None else time.monotonic() + timeout
    first: int | None = None
    try:
        if main:
            signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
        try:
            ctx = tmp.start_processes(
                _entry, args=(call, nprocs, free_port(), results), nprocs=nprocs, join=False, start_method=method
            )
            ranks.extend(ctx.processes)
        finally:
            if main:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)
        if missed:
            pass_on(missed[-1], len(signals))
        while True:
            drain()
            first = _first_failure(ctx.processes) if first is None else first   # before join stops the rest
            if ctx.join(timeout=0.1):
                break
            if deadline is not None and time.monotonic() > deadline:
                _terminate(ctx.processes)
                raise TimeoutError(f"launched processes did not finish within {timeout} s")
    except (tmp.ProcessRaisedException, tmp.ProcessExitedException) as e:
        drain()
        if signals and not errors:           # we were asked to stop; a rank that failed on its own is named
            _terminate(ctx.processes)
            raise _interrupted(signals, stopped) from None
        lost = e.error_index if first is None else first
        details = "".join(f"\n-- rank {r} raised:\n{errors[r][0]}" for r in sorted(errors))
        raised = {r: exc for r, (_, exc) in errors.items() if exc is not None}
        raise LaunchError(f"rank {lost} {_fate(ctx.processes[lost].exitcode)}; the other processes were "
                          f"stopped{details}", lost, sorted(errors), raised) from e
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    drain()
    if signals or stopped:
        raise _interrupted(signals, stopped)
    return [collected.get(r) for r in range(nprocs)]


class _Pickler(pickle.Pickler):
    """Pickles by reference, as spawn does, noting the first class or function it names that only this
    interpreter has: one of a ``__main__`` that a fresh interpreter cannot import (a notebook, a REPL)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        main = sys.modules.get("__main__")
        self.main_importable = os.path.isfile(getattr(main, "__file__", None) or "") or \
            getattr(getattr(main, "__spec__", None), "name", None) is not None   # a script, or -m
        self.unimportable: str | None = None

    def reducer_override(self, obj: Any) -> Any:
        if self.unimportable is None and isinstance(obj, (type, types.FunctionType)) \
                and obj.__module__ == "__main__" and not self.main_importable:
            self.unimportable = obj.__qualname__
        return NotImplemented


def _start(fn: Callable[..., Any], args: tuple, start_method: str | None) -> tuple[str, bytes | tuple]:
    """The start method, and what each process gets: ``(fn, args)`` pickled (``_entry`` unpickles it, where
    a failure is reported), or as it is when forked."""
    why = None
    if start_method != "fork":
        buffer = io.BytesIO()
        pickler = _Pickler(buffer)
        try:
            pickler.dump((fn, args))
        except Exception as exc:
            why = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        else:
            why = pickler.unimportable and f"{pickler.unimportable} is defined in a notebook or an interactive session"
    forkable = "fork" in multiprocessing.get_all_start_methods()
    method = start_method or ("fork" if why and forkable else "spawn")
    if method != "fork":
        if why:
            fork = ', or start_method="fork"' if forkable else ""
            raise pickle.PicklingError(f"launch cannot send {getattr(fn, '__qualname__', fn)} and its arguments to "
                                       f"processes started by {method}: {why}; define them in a .py file and import "
                                       f"them{fork}")
        return method, buffer.getvalue()
    if torch.cuda.is_initialized():
        raise RuntimeError(f"launch forks here ({why or 'start_method=fork'}), but CUDA is already initialized in "
                           "this kernel: a forked process cannot use it; restart the kernel and call launch before "
                           "any CUDA work, or put fn in a .py file")
    _release_openmp_threads()
    return method, (fn, args)


def _release_openmp_threads() -> None:
    """End this thread's OpenMP thread pool before a fork (``omp_pause_resource_all``, OpenMP 5).

    A forked process inherits GNU OpenMP's record of the pool but not its threads, and its first
    multi-threaded operation waits for them for ever; the pool is made again here when next needed.
    """
    try:
        pause = ctypes.CDLL(None).omp_pause_resource_all
    except (AttributeError, OSError):    # no OpenMP runtime loaded, or one without the call
        return
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    pause(2)                             # omp_pause_hard


def _sendable(exc: BaseException) -> BaseException | None:
    """``exc`` if it survives pickling (to cross to the launcher), else None."""
    try:
        return pickle.loads(pickle.dumps(exc))
    except Exception:
        return None


def _interrupted(signals: list[int], stopped: dict[int, tuple]) -> Interrupted:
    """The launcher's stop: the first signal it got (else the ranks'), reported if a rank said where it stopped,
    with the lowest rank's saved run (``run_dir`` and ``steps``: a training run's checkpoint) if it has one."""
    signum = signals[0] if signals else max(s[0] for s in stopped.values())
    stop = Interrupted(signum)
    stop.reported = any(s[1] for s in stopped.values())
    stop.run_dir, stop.steps = next(((s[2], s[3]) for _, s in sorted(stopped.items()) if s[2] is not None),
                                    (None, None))
    return stop


def _first_failure(processes: list) -> int | None:
    """The rank that failed first as seen now: killed by a signal first, else exited non-zero; None if none."""
    codes = [(r, p.exitcode) for r, p in enumerate(processes) if p.exitcode not in (None, 0)]
    killed = [r for r, code in codes if code < 0]
    return (killed or [r for r, _ in codes] or [None])[0]


def _fate(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"was killed by signal {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"


def _terminate(processes: list) -> None:
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()
