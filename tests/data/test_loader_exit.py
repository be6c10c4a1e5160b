"""A script that used a loader with workers exits: after part of an epoch, a whole one, several.

Interpreter exit sends the workers SIGTERM and joins them, so they must end on their
parent's SIGTERM; SIGTERM from anyone else (torchrun's kill of a rank's process group) must
leave them running until the training process stops them. Each script runs as a user runs
it: in a subprocess, with a timeout.
"""

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

HEADER = """
import os, signal, subprocess, sys
from yolokit.data import DetectionDataset, build_dataloader
ds = DetectionDataset(sys.argv[1], "train", imgsz=64, augment=True)
"""

SCRIPTS = {
    "part of an epoch": """
        loader = build_dataloader(ds, 4, workers=2)
        print(next(iter(loader))["images"].shape[0])
    """,
    "several epochs, Mosaic switched off on the way": """
        loader = build_dataloader(ds, 4, workers=2)
        for epoch in range(3):
            ds.mosaic = epoch < 2
            loader.set_epoch(epoch)
            n = sum(len(b["indices"]) for b in loader)
        print(n)
    """,
    "a live iterator of non-persistent workers": """
        loader = build_dataloader(ds, 4, workers=2, persistent_workers=False)
        it = iter(loader)
        print(next(it)["images"].shape[0])
    """,
}
EXPECTED = {"part of an epoch": "4", "several epochs, Mosaic switched off on the way": "24",
            "a live iterator of non-persistent workers": "4"}


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_a_script_that_used_a_loader_exits(shapes_yaml, tmp_path, name):
    script = tmp_path / "script.py"
    script.write_text(HEADER + textwrap.dedent(SCRIPTS[name]))
    try:
        done = subprocess.run([sys.executable, str(script), str(shapes_yaml)], capture_output=True, text=True,
                              timeout=120, start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        subprocess.run(["pkill", "-9", "-f", str(script)])
        pytest.fail(f"{name}: still running after its work was done: {exc.stdout!r}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [EXPECTED[name]]


def test_close_ends_the_workers_and_the_next_epoch_starts_new_ones(shapes_yaml):
    from yolokit.data import DetectionDataset, build_dataloader

    loader = build_dataloader(DetectionDataset(shapes_yaml, "train", imgsz=64, augment=True), 4, workers=2)
    next(iter(loader))
    workers = list(loader._iterator._workers)
    assert len(workers) == 2 and all(w.is_alive() for w in workers)
    loader.close()
    assert not any(w.is_alive() for w in workers) and loader._iterator is None
    assert sum(len(b["indices"]) for b in loader) == 24
    loader.close()


def test_workers_outlive_a_sigterm_to_the_process_group_until_the_parent_stops(shapes_yaml, tmp_path):
    """torchrun stops a rank with SIGTERM to its whole process group: the workers keep loading
    while the training process finishes its step; then it ends them and exits."""
    script = tmp_path / "script.py"
    script.write_text(HEADER + textwrap.dedent("""
        got = []
        signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
        loader = build_dataloader(ds, 2, workers=2)
        images = 0
        for i, batch in enumerate(loader):
            images += len(batch["indices"])
            if i == 1:   # as torchrun's agent does: another process signals the whole group
                subprocess.run(["kill", "-TERM", "--", f"-{os.getpgid(0)}"], check=True, start_new_session=True)
        print(images, got == [signal.SIGTERM])
    """))
    done = subprocess.run([sys.executable, str(script), str(shapes_yaml)], capture_output=True, text=True,
                          timeout=120, start_new_session=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["24", "True"]


STUCK_START = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)   # as in a terminal
from yolokit.data.workers import signals_deferred
r, w = os.pipe()
with signals_deferred():            # a worker start that never returns (a spawned child died early)
    print("starting", flush=True)
    os.read(r, 1)
print("never here", flush=True)
"""


def test_a_second_ctrl_c_ends_a_worker_start_that_hangs():
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-c", STUCK_START], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "starting"
        proc.send_signal(signal.SIGINT)
        # the second only once the first was handled: two sent before the child runs its handler (a loaded
        # machine) arrive as one, as two quick presses of Ctrl-C may
        assert "again to stop now" in proc.stdout.readline()
        time.sleep(0.2)
        assert proc.poll() is None                     # the first is kept for after the start
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode != 0 and "KeyboardInterrupt" in out and "never here" not in out
