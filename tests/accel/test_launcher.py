"""launch: in place for one process or under torchrun; spawned ranks get torchrun's env; forked ranks run what a
fresh interpreter could not import (a notebook's functions; the real kernel: tests/test_notebook_processes.py)."""

import os
import pickle
import signal
import sys
import threading
import time
import types
from pathlib import Path

import _accel_workers as workers  # tests/accel is put on sys.path by conftest.py
import _launch_workers as sent
import pytest
import torch

from yolokit.accel import launcher
from yolokit.accel.launcher import LaunchError, free_port, launch, under_torchrun
from yolokit.accel.stop import Interrupted


def test_free_port():
    assert 0 < free_port() < 65536


def test_one_process_runs_in_place(clean_env):
    [result] = launch(workers.report_env, 1, "solo")
    assert result["pid"] == os.getpid() and result["tag"] == "solo" and result["RANK"] is None


def test_under_torchrun_runs_in_place(clean_env, monkeypatch):
    assert not under_torchrun()
    for k, v in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(k, v)
    assert under_torchrun()
    [result] = launch(workers.report_env, 2, "torchrun")
    assert result["pid"] == os.getpid() and result["RANK"] == "1"


def test_spawned_ranks_get_torchrun_env(gloo_suite):
    envs = [r["env"] for r in gloo_suite]  # launch(workers.ddp_suite, 2), shared via conftest
    assert [e["RANK"] for e in envs] == ["0", "1"] and [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"2"} and {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"}
    assert len({e["MASTER_PORT"] for e in envs}) == 1 and envs[0]["MASTER_ADDR"] == "127.0.0.1"
    assert len({e["pid"] for e in envs} | {os.getpid()}) == 3 and {e["tag"] for e in envs} == {"suite"}


def test_launched_processes_share_the_cores(gloo_suite):
    """Each of 2 ranks gets half the cores (a fresh interpreter would take them all: 2 here)."""
    assert {r["torch_threads"] for r in gloo_suite} == {max(1, (os.cpu_count() or 1) // 2)}
    assert gloo_suite[0]["env"]["OMP_NUM_THREADS"] is None     # the launcher decided, not the environment


def test_a_failed_rank_is_named_even_when_the_others_stop_cleanly(clean_env):
    """The others end on PyTorch's SIGTERM as a stop would; that is no interrupt of the launcher. Rank 1 fails
    as it unpickles its arguments, before the function runs: reported all the same, with its error."""
    with pytest.raises(LaunchError) as err:
        launch(sent.sleep_with, 2, sent.BrokenOnRankOne(), timeout=90)
    assert err.value.ranks == [1] and "ValueError: this argument cannot be rebuilt on rank 1" in str(err.value)
    assert isinstance(err.value.errors[1], ValueError)


def test_a_failure_is_named_even_when_a_stop_cut_its_handling_short(clean_env, tmp_path):
    """Ctrl-C while a rank was failing: the failure is reported, not hidden behind the interrupt."""
    ready = tmp_path / "ready"

    def ctrl_c_when_ready():
        while not ready.exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)   # what a terminal's Ctrl-C does to the launcher

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)   # as in a terminal, even when pytest
    try:                                                                  # runs as a background job (SIGINT ignored)
        threading.Thread(target=ctrl_c_when_ready, daemon=True).start()
        with pytest.raises(LaunchError) as err:
            launch(workers.rank_one_fails_while_a_stop_comes, 2, str(ready), timeout=90)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert 1 in err.value.ranks and "ValueError: boom while stopping" in str(err.value)


def test_timeout_terminates_the_processes(clean_env):
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        launch(workers.sleep_forever, 2, timeout=2)
    assert time.monotonic() - start < 20


def _cell_function(x):
    return x


@pytest.fixture
def notebook(monkeypatch):
    """``__main__`` as a notebook has it (no file to run again), holding ``_cell_function``."""
    main = types.ModuleType("__main__")
    monkeypatch.setattr(_cell_function, "__module__", "__main__")
    main._cell_function = _cell_function
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)


def test_what_a_fresh_interpreter_imports_is_spawned_and_pickled_once(notebook):
    method, call = launcher._start(sent.threaded_sum, (1, "a"), None)
    assert method == "spawn" and pickle.loads(call) == (sent.threaded_sum, (1, "a"))
    assert launcher._start(sent.threaded_sum, (), "forkserver")[0] == "forkserver"


def test_a_notebooks_function_or_what_cannot_be_pickled_is_forked(notebook):
    assert launcher._start(_cell_function, (1,), None) == ("fork", (_cell_function, (1,)))
    assert launcher._start(sent.threaded_sum, (lambda: 1,), None)[0] == "fork"


def test_spawning_a_notebooks_function_is_refused_at_once_in_one_line(notebook):
    with pytest.raises(pickle.PicklingError) as err:
        launch(_cell_function, 2, 1, start_method="spawn")
    assert str(err.value) == ("launch cannot send _cell_function and its arguments to processes started by spawn: "
                              "_cell_function is defined in a notebook or an interactive session; define them in a "
                              '.py file and import them, or start_method="fork"')


def test_fork_is_refused_once_cuda_is_initialized(notebook, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError) as err:
        launch(_cell_function, 2, 1)
    assert "\n" not in str(err.value) and "CUDA is already initialized in this kernel: a forked process cannot use " \
        "it; restart the kernel and call launch before any CUDA work, or put fn in a .py file" in str(err.value)


def test_forked_ranks_use_threads_after_this_process_used_openmp(clean_env):
    """GNU OpenMP's pool does not survive a fork: launch ends it first, or a rank's first multi-threaded
    operation would wait for ever."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        (torch.ones(256, 256) * 2 + 1).sum()
        assert launch(sent.threaded_sum, 2, start_method="fork", timeout=60) == [sent.threaded_sum()] * 2
    finally:
        torch.set_num_threads(threads)


def test_forked_ranks_are_stopped_once_by_a_ctrl_c(clean_env, tmp_path):
    def ctrl_c_when_ready():
        while len(list(tmp_path.iterdir())) < 2:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=ctrl_c_when_ready, daemon=True).start()
        with pytest.raises(Interrupted) as err:
            launch(sent.ready_then_sleep, 2, str(tmp_path), start_method="fork", timeout=60)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert err.value.signum == signal.SIGINT and sorted(p.name for p in Path(tmp_path).iterdir()) == ["0", "1"]


def test_a_ctrl_c_while_the_ranks_start_stops_them_once_they_run(clean_env, tmp_path, monkeypatch):
    """A SIGINT that lands while the ranks are being forked (here: the moment the last one is started)
    is recorded by the launcher's handler and passed on once they run: Interrupted, every rank
    stopped. Under the default handler it raised KeyboardInterrupt inside fork's hooks, where Python
    drops it, and the ranks slept on until the timeout (seen once in the default run)."""
    start = launcher.tmp.start_processes

    def start_then_ctrl_c(*args, **kwargs):
        ctx = start(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        return ctx

    monkeypatch.setattr(launcher.tmp, "start_processes", start_then_ctrl_c)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    began = time.monotonic()
    try:
        with pytest.raises(Interrupted) as err:
            launch(sent.ready_then_sleep, 2, str(tmp_path), start_method="fork", timeout=60)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert err.value.signum == signal.SIGINT and time.monotonic() - began < 30
