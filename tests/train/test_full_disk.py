"""A disk that fills up mid-run: the previous checkpoint stays, one line says so and how to resume.

The writer is the real one (``yolokit.train.files``) with its file swapped for one that raises
ENOSPC part-way through the third checkpoint (epoch 2's ``last.pt``), as a full filesystem
does. The run goes through the real command in a subprocess.
"""

from __future__ import annotations

import errno
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _models import TINY
from _torchrun_env import subprocess_env

from yolokit.data import make_shapes
from yolokit.train.checkpoint import load_checkpoint
from yolokit.train.files import SaveError, atomic_save, write_text

pytestmark = pytest.mark.slow

# The command line, with the checkpoint writer's FAIL_AT-th file failing after 4 KB as a full disk would.
FILLS_UP = """
import errno, os, sys
import yolokit.train.files as files

FAIL_AT, opened, real = int(sys.argv[1]), [0], files._CountingFile.__init__

class Full:
    def __init__(self, f):
        self.f, self.n = f, 0
    def write(self, data):
        self.n += len(data)
        if self.n > 4096:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.f.write(data)
    def fileno(self):
        return self.f.fileno()
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self.f.close()

def init(self, fd):
    real(self, fd)
    opened[0] += 1
    if opened[0] == FAIL_AT:
        self.file = Full(self.file)

files._CountingFile.__init__ = init
from yolokit.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _descendants_alive(token: str) -> list[str]:
    """Command lines of processes still running that mention ``token`` (this run's folder)."""
    left = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if token in cmdline and state != "Z":
                left.append(cmdline)
    return left


def test_a_full_disk_keeps_the_last_checkpoint_and_says_so_in_one_line(tmp_path):
    data = make_shapes(tmp_path / "shapes", n_train=8, n_val=4, imgsz=64)
    run = tmp_path / "run"
    flags = ["train", "--data", str(data), "--model", TINY, "--imgsz", "64", "--batch", "4", "--nbs", "4",
             "--epochs", "3", "--workers", "1", "--no-plots", "--out", str(run)]   # the disk's path, a small net
    done = subprocess.run([sys.executable, "-c", FILLS_UP, "3", *flags], env=subprocess_env(), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]   # besides the epoch bars
    assert "Traceback" not in done.stderr and len(errors) == 1, done.stderr[-3000:]
    last = run / "weights" / "last.pt"
    line = errors[0][errors[0].index("yolokit train: error:"):]      # after the last bar's carriage returns
    assert line.startswith(f"yolokit train: error: cannot write {last}: No space left on device (needs ")
    assert f"{last} is intact (after epoch 1); free some space and resume with: yolokit train --resume {run}" in line
    assert load_checkpoint(last)["epoch"] == 1                              # the previous checkpoint, whole
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["best.pt", "last.pt"]   # no temporary left
    assert not _descendants_alive(str(run)), "a process of the run is still running"
    needed = float(line.split("(needs ")[1].split(" MB")[0])
    size = last.stat().st_size / 2**20                                      # epoch 2's file held the same
    assert abs(needed - size) / size < 0.05, (needed, size)
    resumed = subprocess.run([sys.executable, "-m", "yolokit", "train", "--resume", str(run)], env=subprocess_env(),
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert load_checkpoint(last)["epoch"] == 3


class _Full:
    """A file whose writes fail with ENOSPC once 100 bytes went out, as a full filesystem's do."""

    def __init__(self, file):
        self.file, self.n = file, 0

    def write(self, data):
        self.n += len(memoryview(data).cast("B"))
        if self.n > 100:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.file.write(data)

    def fileno(self):
        return self.file.fileno()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def test_a_failed_write_names_the_file_and_its_size_and_leaves_the_old_file(tmp_path, monkeypatch):
    import yolokit.train.files as files

    path = tmp_path / "last.pt"
    atomic_save({"epoch": 1}, path)
    state = {"epoch": 2, "w": torch.arange(10_000.0)}
    whole = io.BytesIO()
    torch.save(state, whole)
    real = files.os.fdopen
    monkeypatch.setattr(files.os, "fdopen", lambda fd, *args, **kwargs: _Full(real(fd, *args, **kwargs)))
    with pytest.raises(SaveError) as err:
        atomic_save(state, path)
    monkeypatch.undo()
    assert err.value.path == path and err.value.needed == len(whole.getvalue())   # what the whole file needed
    size = f"{len(whole.getvalue()) / 1024:.1f} KB"
    assert str(err.value).startswith(f"cannot write {path}: No space left on device (needs {size}, ")
    assert load_checkpoint(path)["epoch"] == 1 and [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_a_run_file_that_cannot_be_written_is_a_save_error(tmp_path):
    (tmp_path / "blocker").write_text("a file where a folder should be")
    with pytest.raises(SaveError, match=r"cannot write .*results.csv: .*\(needs 2 B, "):
        write_text(tmp_path / "blocker" / "results.csv", "x\n", append=True)


def test_a_full_disk_while_writing_best_pt_is_a_save_error_and_the_old_file_stays(tmp_path, monkeypatch):
    import yolokit.train.files as files
    from yolokit.models import create_model
    from yolokit.train import TrainConfig
    from yolokit.train.weights import export_final

    model, path = create_model("yolov8n", num_classes=2), tmp_path / "best.pt"
    export_final(model, path, ["a", "b"], TrainConfig(), extra={"epoch": 1})
    before = path.read_bytes()
    real = files.os.fdopen
    monkeypatch.setattr(files.os, "fdopen", lambda fd, *args, **kwargs: _Full(real(fd, *args, **kwargs)))
    with pytest.raises(SaveError) as err:
        export_final(model, path, ["a", "b"], TrainConfig(), extra={"epoch": 2})
    monkeypatch.undo()
    assert err.value.path == path and abs(err.value.needed - len(before)) / len(before) < 0.01   # float16 weights
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["best.pt"]
