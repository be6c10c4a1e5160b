"""`torchrun -m yolokit train`: the world comes from torchrun (no --devices), on one node or two.

Two "machines" are two torchrun agents on this machine meeting at a c10d rendezvous on
127.0.0.1; they must train exactly (bit for bit) what one agent with two processes trains.
"""

from __future__ import annotations

import csv
import sys

import pytest
from _torchrun_env import output, start

from yolokit.accel.launcher import free_port
from yolokit.data import make_shapes
from yolokit.testing import assert_weights_equal
from yolokit.train.checkpoint import load_checkpoint

pytestmark = pytest.mark.slow

def _torchrun(*flags: str, out, data, background: bool = False):
    cmd = [sys.executable, "-m", "torch.distributed.run", *flags, "-m", "yolokit", "train", "--data", data,
           "--imgsz", "64", "--batch", "4", "--nbs", "8", "--epochs", "2", "--workers", "0", "--no-plots",
           "--mosaic-buffer", "0", "--close-mosaic", "1", "--out", str(out)]
    proc = start(cmd)
    return proc if background else _finish(proc)


def _finish(proc) -> str:
    out = output(proc, 400)
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.mark.extended   # the launcher's two-node environment; one node of two processes runs by default
def test_two_nodes_train_exactly_like_one_node_with_two_processes(tmp_path):
    data = str(make_shapes(tmp_path / "set", n_train=13, n_val=6, imgsz=64))
    log = _torchrun("--nnodes", "1", "--nproc-per-node", "2", out=tmp_path / "one_node", data=data)
    assert "2 x cpu, batch 4 (2 per process) x 2 accumulation = 8 per step" in log
    assert log.count('"run_dir"') == 1   # the final metrics are printed once, by rank 0

    rdzv = ("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "yolokit-test")
    nodes = [_torchrun(*rdzv, out=tmp_path / "two_nodes", data=data, background=True) for _ in range(2)]
    logs = [_finish(p) for p in nodes]
    assert sum("2 x cpu, batch 4 (2 per process)" in text for text in logs) == 1   # printed by rank 0 only

    a = load_checkpoint(tmp_path / "one_node" / "weights" / "last.pt")
    b = load_checkpoint(tmp_path / "two_nodes" / "weights" / "last.pt")
    assert a["epoch"] == b["epoch"] == 2 and a["steps"] == b["steps"] > 0
    assert_weights_equal(a["model"], b["model"])
    assert_weights_equal(a["ema"]["module"], b["ema"]["module"])
    def first_row(run):   # all but the timings
        row = next(csv.DictReader((run / "results.csv").open()))
        return {k: v for k, v in row.items() if k not in ("seconds", "data%")}
    assert first_row(tmp_path / "one_node") == first_row(tmp_path / "two_nodes")
