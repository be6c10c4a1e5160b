"""launch: in place for one process or under torchrun; spawned ranks get torchrun's env."""

import os
import signal
import threading
import time

import _accel_workers as workers  # tests/accel is put on sys.path by conftest.py
import pytest

from yolokit.accel.launcher import LaunchError, free_port, launch, under_torchrun


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
    """The others end on PyTorch's SIGTERM as a stop would; that is no interrupt of the launcher."""
    with pytest.raises(LaunchError) as err:
        launch(workers.rank_one_raises_while_rank_zero_sleeps, 2, timeout=90)
    assert err.value.ranks == [1] and "ValueError: boom on rank 1" in str(err.value)


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
