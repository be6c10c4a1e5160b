"""A rank killed mid-epoch (SIGKILL): the run stops quickly and names it, or torchrun restarts it.

Both tests start real command lines (``yolokit train --devices 2``; ``torchrun ... -m yolokit
train``), wait until the first iteration checkpoint exists (``--save-period-iters 1``: the
first optimizer step is done, so training is under way, mid-epoch), and SIGKILL rank 1's
process, found in /proc among the launcher's children.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _torchrun_env import output, start

from yolokit.data import make_shapes
from yolokit.train.checkpoint import load_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")]

@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """24 images in micro-batches of 2, 2 processes accumulating 2: 3 optimizer steps per epoch."""
    return str(make_shapes(tmp_path_factory.mktemp("shapes") / "set", n_train=24, n_val=4, imgsz=64))


def _train_flags(data: str, out: Path, epochs: int) -> list[str]:
    return ["train", "--data", data, "--imgsz", "64", "--batch", "4", "--nbs", "8", "--epochs", str(epochs),
            "--workers", "0", "--no-plots", "--mosaic-buffer", "0", "--close-mosaic", "1",
            "--save-period-iters", "1", "--out", str(out)]


def _children(pid: int) -> list[tuple[int, int, bytes, bytes]]:
    """(start time, pid, command line, environment) of ``pid``'s child processes, oldest first."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()   # from the state field on
            if int(fields[1]) == pid:
                found.append((int(fields[19]), int(entry.name), (entry / "cmdline").read_bytes(),
                              (entry / "environ").read_bytes()))
        except (OSError, ValueError):
            continue
    return sorted(found)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.is_file():
        if proc.poll() is not None:
            pytest.fail(f"training ended before {path} was written:\n{proc.communicate()[0][-4000:]}")
        assert time.monotonic() < deadline, f"{path} not written within {timeout} s"
        time.sleep(0.05)


def test_a_killed_rank_stops_the_run_within_a_minute_and_is_named(shapes, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "yolokit", *_train_flags(shapes, out, epochs=50), "--devices", "2"]
    proc = start(cmd)
    _wait_for(out / "weights" / "last.pt", proc)
    ranks = [pid for _, pid, cmdline, _ in _children(proc.pid) if b"spawn_main" in cmdline]
    assert len(ranks) == 2, _children(proc.pid)
    os.kill(ranks[1], signal.SIGKILL)                    # rank 1: started second
    killed = time.monotonic()
    log = output(proc, 120)
    elapsed = time.monotonic() - killed
    assert proc.returncode != 0 and elapsed < 60, (proc.returncode, elapsed, log[-4000:])
    assert "rank 1 was killed by signal SIGKILL; the other processes were stopped" in log, log[-4000:]
    assert load_checkpoint(out / "weights" / "last.pt")["epoch"] < 50


def _torchrun(out: Path, data: str, epochs: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", "-m", "yolokit", *_train_flags(data, out, epochs), "--resume", "auto"]
    return start(cmd)


@pytest.mark.extended   # 51 s; a lost rank resumed bit for bit: test_resume_iters.py; torchrun: test_torchrun.py
def test_torchrun_restarts_the_group_and_it_resumes_from_the_last_checkpoint(shapes, tmp_path):
    """``--max-restarts --resume auto``: after rank 1 is killed, the restarted group finds the same
    run folder, resumes from its last iteration checkpoint and ends with the bits of a run never killed."""
    whole = _torchrun(tmp_path / "whole", shapes, epochs=3)
    log = output(whole, 400)
    assert whole.returncode == 0, log[-4000:]

    proc = _torchrun(tmp_path / "killed", shapes, epochs=3)
    _wait_for(tmp_path / "killed" / "weights" / "last.pt", proc)
    workers = [pid for _, pid, _, env in _children(proc.pid) if b"\0RANK=1\0" in b"\0" + env]
    assert len(workers) == 1, _children(proc.pid)
    os.kill(workers[0], signal.SIGKILL)
    log = output(proc, 400)
    assert proc.returncode == 0, log[-4000:]
    assert "resuming at optimizer step" in log or "resuming after epoch" in log, log[-4000:]

    a = load_checkpoint(tmp_path / "whole" / "weights" / "last.pt")
    b = load_checkpoint(tmp_path / "killed" / "weights" / "last.pt")
    assert a["epoch"] == b["epoch"] == 3 and a["steps"] == b["steps"] == 9
    for key, value in a["model"].items():
        assert torch.equal(b["model"][key], value), key
    for key, value in a["ema"]["module"].items():
        assert torch.equal(b["ema"]["module"][key], value), key
    def rows(run):   # all but the timings
        return [{k: v for k, v in r.items() if k not in ("seconds", "data%")}
                for r in csv.DictReader((tmp_path / run / "results.csv").open())]
    # one row per epoch: the restart found the same folder
    assert [r["epoch"] for r in rows("killed")] == ["1", "2", "3"]
    assert rows("killed") == rows("whole")
