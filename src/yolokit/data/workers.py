"""Loader worker processes: how they start, and how signals reach them (the start method they get, and how
a notebook's dataset reaches them: `yolokit.data.start_method`).

Ctrl-C reaches a whole process group and torchrun stops a rank by signalling its whole
group, so the workers ignore both and the training process, which stops at a step
boundary, ends them; the parent's own SIGTERM (its shutdown of the workers, and the
interpreter's exit) ends them at once, so a script that used a loader exits.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Iterator
from multiprocessing.context import get_spawning_popen

import cv2


class SharedArray:
    """A small typed array in shared memory (``.array``), seen by the loader's workers however they start.

    Inherited by forked workers and passed to spawned ones; pickled at any other time (a deepcopy, a
    checkpoint) it becomes an independent copy.

    Args:
        typecode: the `multiprocessing.RawArray` type ("q" int64, "b" int8, ...).
        values: the initial values.
    """

    def __init__(self, typecode: str, values: list[int]) -> None:
        self.array = multiprocessing.RawArray(typecode, values)

    def __getstate__(self) -> dict:
        if get_spawning_popen() is not None:
            return {"array": self.array}
        return {"typecode": self.array._type_._type_, "values": list(self.array)}

    def __setstate__(self, state: dict) -> None:
        self.array = state["array"] if "array" in state else multiprocessing.RawArray(state["typecode"],
                                                                                    state["values"])


@contextlib.contextmanager
def signals_deferred(active: bool = True) -> Iterator[None]:
    """SIGINT / SIGTERM that arrive while workers start are acted on right after.

    A handler that raises (Ctrl-C's ``KeyboardInterrupt``) would raise inside ``fork``'s
    at-fork hooks, where Python drops the exception, and in a new worker before it ignores
    SIGINT, killing it. Here a signal is only recorded, and sent again once the handlers are
    back (main thread only; elsewhere handlers cannot change). A second signal acts at once:
    a start can hang (a spawned worker that dies while its parent still writes its arguments,
    as one of a script without ``if __name__ == "__main__":`` does), and Ctrl-C again ends it.
    """
    if not active or threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    signals = (signal.SIGINT, signal.SIGTERM)

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def record(signum: int, frame) -> None:
        got.append(signum)
        if len(got) == 1:
            sys.stderr.write(f"{signal.Signals(signum).name}: stopping once the loader's workers have started "
                             "(again to stop now)\n")
        else:                                   # the second: the previous handler, now
            got.clear()
            restore()
            signal.raise_signal(signum)

    previous = {sig: signal.signal(sig, record) for sig in signals}
    try:
        yield
    finally:
        restore()
        for sig in dict.fromkeys(got):
            signal.raise_signal(sig)


def init_worker(worker_id: int) -> None:
    """A loader worker's start: no nested OpenCV threads, Ctrl-C ignored, SIGTERM only from the parent."""
    cv2.setNumThreads(0)  # one worker per core is the parallelism; no nested threads
    # Ctrl-C reaches the whole process group: the training process decides when to stop (after
    # writing a checkpoint) and shuts its workers down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_on_parent_sigterm()


def _exit_on_parent_sigterm() -> None:
    """SIGTERM from the parent ends this worker; SIGTERM from anyone else is ignored.

    The parent sends it when it shuts its workers down and, at interpreter exit, from
    ``multiprocessing``'s exit function, which then joins them: a worker that ignored it
    would hang the script's exit. Anyone else (torchrun's ``killpg`` of a rank's group, a
    scheduler killing the group) means "stop": the parent stops at an optimizer step
    boundary, which may need a few more batches, and then ends its workers. A worker also
    ends on its own when its parent dies (PyTorch's watchdog). Where ``sigwaitinfo`` is
    missing (macOS), PyTorch's own handler stays: the parent's SIGTERM ends the worker,
    anyone else's kills it.
    """
    if not hasattr(signal, "sigwaitinfo"):
        return
    parent = multiprocessing.parent_process()
    parents = {os.getppid(), parent.pid if parent is not None else os.getppid()}   # forkserver: both
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})   # threads started later inherit the mask

    def wait() -> None:
        while True:
            sender = signal.sigwaitinfo({signal.SIGTERM}).si_pid
            if sender in parents or os.getppid() not in parents:
                os._exit(0)

    threading.Thread(target=wait, name="yolokit-sigterm", daemon=True).start()
