"""Ctrl-C and SIGTERM end every command as a user meets them: in a terminal, in a subprocess.

A terminal's Ctrl-C sends SIGINT to the foreground process group; torchrun, schedulers and
``kill`` send SIGTERM. Each case starts the real entry point in a session of its own, waits
until it is under way, signals the group, and asserts the exit code (130 / 143), that no
traceback was printed, that one line says where it stopped, that no process of the run is
left, and, for training, that ``--resume`` finishes the run.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import cv2
import numpy as np
import pytest
from _processes import alive, descendants
from _torchrun_env import subprocess_env

from yolokit.data import make_shapes

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")]

CODES = {"INT": 130, "TERM": 143}


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return str(make_shapes(tmp_path_factory.mktemp("shapes") / "set", n_train=16, n_val=4, imgsz=64))


def interrupt(cmd: list[str], ready, sig: str, *, cwd: Path, again: float | None = None,
              timeout: float = 240) -> tuple[int, str, float]:
    """Runs ``cmd``; once ``ready(output_so_far)`` holds, sends SIG``sig`` to its process group (as a
    terminal does; ``again``: a second one that many seconds later). Returns the exit code, the
    output and the seconds from the signal to the exit; fails if a process of the run is left."""
    log = cwd / f"output-{time.monotonic_ns()}.txt"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True,
                                env={**subprocess_env(), "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + timeout
        while not ready(log.read_text()):
            assert proc.poll() is None, f"ended before it was interrupted:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"never got under way:\n{log.read_text()[-3000:]}"
            time.sleep(0.05)
        family = descendants(proc.pid) | {proc.pid}
        sent = time.monotonic()
        os.killpg(proc.pid, getattr(signal, f"SIG{sig}"))
        if again is not None:
            time.sleep(again)
            os.killpg(proc.pid, getattr(signal, f"SIG{sig}"))
        code = proc.wait(timeout=60)
        took = time.monotonic() - sent
        family |= descendants(proc.pid)
        deadline = time.monotonic() + 10     # workers end right after their parent
        while alive(family) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(family), f"left running: {alive(family)}\n{log.read_text()[-3000:]}"
        return code, log.read_text(), took
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def yolokit(*args: str) -> list[str]:
    return [sys.executable, "-m", "yolokit", *args]


def train_args(shapes: str, out: str, *extra: str) -> list[str]:
    return ["train", "--data", shapes, "--imgsz", "64", "--epochs", "2", "--batch", "4", "--nbs", "4",
            "--workers", "2", "--out", out, "--plots", "--save-period-iters", "2", "--close-mosaic", "1", *extra]


def checkpointed(run: Path):
    return lambda text: (run / "weights" / "last.pt").is_file()


def assert_stopped_cleanly(code: int, text: str, sig: str, line: str) -> None:
    assert code == CODES[sig], text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert text.count(line) == 1, text[-3000:]


def assert_resumes(shapes: str, run: Path, tmp_path: Path, *extra: str) -> None:
    done = subprocess.run(yolokit("train", "--resume", str(run), *extra), capture_output=True, text=True,
                          cwd=tmp_path, env=subprocess_env(), timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    # a slow machine may take the signal at an epoch's end, where the stop is an epoch's checkpoint
    assert "resuming at optimizer step" in done.stdout or "resuming after epoch 1" in done.stdout, done.stdout[-2000:]
    rows = list(csv.DictReader((run / "results.csv").open()))
    assert [r["epoch"] for r in rows] == ["1", "2"] and (run / "weights" / "model.pt").is_file()


@pytest.mark.parametrize("sig", ["INT", pytest.param("TERM", marks=pytest.mark.extended)])   # TERM: test_resume_iters
def test_train_stops_at_a_step_saves_and_resumes(shapes, tmp_path, sig):
    run = tmp_path / "run"
    code, text, took = interrupt(yolokit(*train_args(shapes, str(run))), checkpointed(run), sig, cwd=tmp_path)
    assert_stopped_cleanly(code, text, sig, f"resume with `yolokit train --resume {run}`")
    assert took < 30, took
    if sig == "INT":   # resuming does not depend on the signal (the other tests resume too)
        assert_resumes(shapes, run, tmp_path)


@pytest.mark.extended   # ~25 s: the comparison's command (benchmarks/parity.py), its runs processes of their own
def test_parity_command_stops_in_one_line_and_the_same_command_goes_on_from_the_step(shapes, tmp_path):
    """A Ctrl-C during benchmarks/parity.py's first run: exit 130, one line naming the run, no traceback and no
    process left; the same command again resumes that run from its checkpoint and trains the next seed."""
    from _models import TINY

    out = tmp_path / "parity"
    cmd = [sys.executable, str(Path(__file__).resolve().parents[1] / "benchmarks" / "parity.py"), "--model", TINY,
           "--data", shapes, "--sides", "yolokit", "--seeds", "0", "1", "--epochs", "2", "--imgsz", "64",
           "--batch", "4", "--nbs", "4", "--workers", "0", "--out", str(out),
           "--set", "yolokit.save_period_iters=2"]
    code, text, _ = interrupt(cmd, checkpointed(out / "yolokit-0"), "INT", cwd=tmp_path)
    assert_stopped_cleanly(code, text, "INT", "parity.py: stopped during yolokit seed 0;")
    assert "(yolokit-0 on from where it stopped)" in text and not (out / "yolokit-1").exists()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=subprocess_env(), timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "resuming at optimizer step" in done.stdout or "resuming after epoch 1" in done.stdout, done.stdout[-2000:]
    rows = list(csv.DictReader((out / "yolokit-0" / "results.csv").open()))
    assert [r["epoch"] for r in rows] == ["1", "2"]
    runs = json.loads((out / "runs.json").read_text())
    assert [(r["side"], r["seed"], len(r["curve"]["box"])) for r in runs] == [("yolokit", 0, 2), ("yolokit", 1, 2)]


def test_a_second_ctrl_c_stops_at_once(shapes, tmp_path):
    """Two processes: the first Ctrl-C asks both to stop at the next step; the second kills them."""
    run = tmp_path / "run"
    code, text, took = interrupt(yolokit(*train_args(shapes, str(run), "--devices", "2", "--workers", "0")),
                                 checkpointed(run), "INT", cwd=tmp_path, again=0.05)
    assert code == 130 and "Traceback" not in text, text[-3000:]
    assert took < 15, took


@pytest.mark.extended   # the ranks' agreement to stop: test_resume_iters (SIGTERM on one rank, bit for bit);
# two processes stopped from the terminal: test_a_second_ctrl_c_stops_at_once
def test_two_processes_stop_together_and_resume(shapes, tmp_path):
    run = tmp_path / "run"
    code, text, took = interrupt(yolokit(*train_args(shapes, str(run), "--devices", "2", "--workers", "1")),
                                 checkpointed(run), "INT", cwd=tmp_path)
    assert_stopped_cleanly(code, text, "INT", f"resume with `yolokit train --resume {run}`")
    assert_resumes(shapes, run, tmp_path)   # in one process: the checkpoint holds both ranks' states


@pytest.mark.extended   # the same stop as test_two_processes_stop_together_and_resume, through torchrun
def test_torchrun_ranks_stop_together_and_resume(shapes, tmp_path):
    """torchrun passes a Ctrl-C on to its ranks' process groups; the ranks stop at one step and
    exit 130 without a traceback (torchrun's own agent reports the signal with one of its own)."""
    run, logs = tmp_path / "run", tmp_path / "logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--log-dir", str(logs),
           "--redirects", "3", "--tee", "3", "-m", "yolokit", *train_args(shapes, str(run))]
    interrupt(cmd, checkpointed(run), "INT", cwd=tmp_path)
    line = f"resume with `yolokit train --resume {run}`"
    for rank in (0, 1):
        (out,), (err,) = logs.rglob(f"attempt_0/{rank}/stdout.log"), logs.rglob(f"attempt_0/{rank}/stderr.log")
        text = out.read_text() + err.read_text()
        assert "Traceback" not in text and text.count(line) == (rank == 0), text[-3000:]
    assert_resumes(shapes, run, tmp_path)


def test_val_stops_with_one_line(shapes, tmp_path):
    cmd = yolokit("val", "--data", shapes, "--num-classes", "4", "--imgsz", "640", "--batch", "1", "--workers", "2",
                  "--device", "cpu", "--out", str(tmp_path / "val"))
    code, text, _ = interrupt(cmd, lambda t: "val:" in t, "INT", cwd=tmp_path)
    assert_stopped_cleanly(code, text, "INT", "yolokit val: stopped by SIGINT")


@pytest.mark.parametrize("source, sig", [("folder", "TERM"), pytest.param("video", "INT", marks=pytest.mark.extended)])
def test_predict_stops_with_one_line_and_keeps_what_it_wrote(tmp_path, source, sig):
    rng = np.random.default_rng(0)
    if source == "folder":
        (tmp_path / "images").mkdir()
        for i in range(300):
            cv2.imwrite(str(tmp_path / "images" / f"{i:03d}.jpg"), rng.integers(0, 255, (96, 128, 3), dtype=np.uint8))
        target, first = tmp_path / "images", "002.jpg:"
    else:
        target, first = tmp_path / "clip.mp4", "frame 2:"
        writer = cv2.VideoWriter(str(target), cv2.VideoWriter_fourcc(*"mp4v"), 10, (128, 96))
        for _ in range(600):
            writer.write(rng.integers(0, 255, (96, 128, 3), dtype=np.uint8))
        writer.release()
    out = tmp_path / "out"
    cmd = yolokit("predict", str(target), "--num-classes", "2", "--imgsz", "640", "--device", "cpu", "--out", str(out),
                  "--save-txt")
    code, text, _ = interrupt(cmd, lambda t: first in t, sig, cwd=tmp_path)
    done = text.count(": 128x96 ")
    assert_stopped_cleanly(code, text, sig, f"stopped by SIG{sig} after {done} images; their results are in {out}")
    assert 3 <= done < (300 if source == "folder" else 600)
    if source == "video":   # the video written so far is whole: every frame predicted is in it
        capture = cv2.VideoCapture(str(out / "clip.mp4"))
        assert int(capture.get(cv2.CAP_PROP_FRAME_COUNT)) == done
    else:
        assert len(list(out.glob("*.jpg"))) == done



def test_a_stop_raised_inside_a_c_call_that_calls_back_is_still_a_stop():
    """A signal handler that raises while a C function calls back into Python (``np.fromfile`` calling
    ``os.fspath``) surfaces as a SystemError whose context is the stop (seen in `yolokit data shard`): it is
    that stop (exit 130, one line), and any other SystemError stays what it is."""
    from yolokit.accel.stop import Interrupted

    try:
        try:
            raise Interrupted(signal.SIGTERM)
        except Interrupted:
            raise SystemError("<built-in function fspath> returned a result with an exception set") from None
    except SystemError as exc:
        raised = exc
    assert Interrupted.of(raised).exit_code == 128 + signal.SIGTERM
    assert Interrupted.of(KeyboardInterrupt()).exit_code == 130
    with pytest.raises(SystemError, match="other"):
        Interrupted.of(SystemError("other"))
