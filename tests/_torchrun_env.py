"""The environment variables torchrun sets, for tests that must run without them."""

import os

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RESTART_COUNT",
                 "TORCHELASTIC_MAX_RESTARTS")


def subprocess_env() -> dict[str, str]:
    """This process's environment without torchrun's variables, one OpenMP thread per process
    (the same kernels in every layout: torchrun sets 1 only for several local processes)."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env["OMP_NUM_THREADS"] = "1"
    return env


def start(cmd: list[str]):
    """``cmd`` in a session of its own, output captured (``output`` can kill all it started)."""
    import subprocess

    return subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def output(proc, timeout: float) -> str:
    """The output of ``proc`` once it ends; past ``timeout`` its whole session is killed (no ranks
    left running after a failed test) and the test fails with the output so far."""
    import signal
    import subprocess

    import pytest

    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"still running after {timeout} s:\n{proc.communicate()[0][-4000:]}")
