"""Shared test settings: the `gpu` marker skips without CUDA; no test leaks distributed state."""

import os
import sys

import pytest
import torch
import torch.distributed as dist

TESTS = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.join(os.path.dirname(TESTS), "benchmarks")  # the harness lives in the checkout only
for folder in (TESTS, os.path.join(TESTS, "train"), BENCHMARKS):  # shared helpers, workers spawned children import
    if folder not in sys.path:
        sys.path.insert(0, folder)

from _torchrun_env import TORCHRUN_VARS  # noqa: E402  (after the path above)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def clean_env(monkeypatch):
    """No torchrun variables, so launch() spawns and setup() sees a single process."""
    for k in TORCHRUN_VARS:
        monkeypatch.delenv(k, raising=False)


@pytest.fixture(autouse=True)
def _no_leaked_distributed_state():
    """Torchrun variables and the default process group are as they were before the test.

    ``accel.distributed.setup`` writes RANK / WORLD_SIZE / LOCAL_RANK itself; left behind,
    they would make later tests believe they run as another rank. Being autouse in the root
    conftest, this is torn down after any monkeypatch of the test.
    """
    saved = {k: os.environ.get(k) for k in TORCHRUN_VARS}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
