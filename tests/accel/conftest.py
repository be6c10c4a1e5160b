"""Shared fixtures for tests/accel: one 2-process gloo run reused by several tests."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # spawned children import the workers by name
import _accel_workers as workers  # noqa: E402
from _torchrun_env import TORCHRUN_VARS  # noqa: E402


@pytest.fixture(scope="session")
def gloo_suite():
    """Results of ``workers.ddp_suite`` on 2 spawned gloo processes (spawning costs seconds). Without
    OMP_NUM_THREADS (tests/conftest.py sets it to 1 for the suite), as a user's shell starts them, so
    that launch() shares the cores out itself."""
    from yolokit.accel.launcher import launch

    saved = {k: os.environ.pop(k) for k in (*TORCHRUN_VARS, "OMP_NUM_THREADS") if k in os.environ}
    try:
        return launch(workers.ddp_suite, 2, timeout=150)
    finally:
        os.environ.update(saved)
