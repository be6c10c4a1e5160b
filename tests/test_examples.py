"""The scripts in examples/ run as their docstrings say, and produce what they claim."""

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import torch

import yolokit
from yolokit.data import make_shapes

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(script, *args, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def test_custom_loop_trains_on_two_processes_and_its_weights_load_back(tmp_path):
    out = run("custom_loop.py", "--epochs", 1, "--imgsz", 64, "--batch", 6, "--nominal-batch", 18, "--workers", 0,
              "--nprocs", 2, "--save", tmp_path / "w.pt", cwd=tmp_path)
    assert "rank 0: cpu" in out and "rank 1: cpu" in out
    # 64 images in micro-batches of 3: 22 (the last of 1 image); 3 steps of 2 ranks x 3, then the
    # last 4 go to the lowest ranks first: rank 0 runs 12, rank 1 runs 10 (uneven shards)
    assert "epoch 1/1" in out and "(12 batches of 3 per process" in out
    loss = float(re.search(r"final loss ([0-9.]+)", out).group(1))
    assert math.isfinite(loss) and loss > 0
    model = yolokit.load(tmp_path / "w.pt")
    assert model.num_classes == 4
    saved = torch.load(tmp_path / "w.pt", weights_only=True)
    assert torch.equal(model.state_dict()["head.cls.0.2.weight"], saved["head.cls.0.2.weight"])


def test_predict_example_draws_every_image_of_a_folder(tmp_path):
    torch.manual_seed(0)
    yolokit.save(yolokit.create_model("yolov8n", num_classes=2), tmp_path / "m.safetensors", names=["a", "b"])
    rng = np.random.default_rng(0)
    for rel, (h, w) in {"imgs/x.jpg": (48, 64), "imgs/sub/y.png": (40, 30)}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        cv2.imwrite(str(tmp_path / rel), rng.integers(0, 255, (h, w, 3), np.uint8))
    out = run("predict.py", tmp_path / "m.safetensors", tmp_path / "imgs", "--imgsz", 64, "--conf", 0.0,
              "--out", tmp_path / "drawn", cwd=tmp_path)
    assert [line.split(":")[0] for line in out.splitlines()] == ["sub/y.png", "x.jpg"]
    drawn = sorted(p.name for p in (tmp_path / "drawn").iterdir())
    assert drawn == ["00000_y.jpg", "00001_x.jpg"]
    assert cv2.imread(str(tmp_path / "drawn" / "00000_y.jpg")).shape == (40, 30, 3)  # original size, drawn on


def test_own_network_trains_four_networks_and_compares_them(tmp_path):
    out = run("own_network.py", "--epochs", 1, "--imgsz", 64, "--images", 8, "--out", tmp_path / "runs", cwd=tmp_path)
    assert "baseline: yolov8n trained" in out and "p2: yolov8n-p2 trained" in out and "se: v8-se-n trained" in out
    timm = importlib.util.find_spec("timm") is not None
    assert ("timm: mnv3-small-pan trained" in out) == timm
    table = out[out.index("timm:" if timm else "se:"):]
    for run_dir in ("baseline", "p2", "se") + (("timm",) if timm else ()):
        assert str(tmp_path / "runs" / run_dir) in table                # each run in the comparison


def test_shards_s3_writes_trains_and_resumes_from_the_store(s3_env, tmp_path):
    import pytest

    pytest.importorskip("litdata", reason="needs yolokit[stream]")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "YOLOKIT_CACHE": str(tmp_path / "cache")}
    data = make_shapes(tmp_path / "set", n_train=24, n_val=8, imgsz=64)   # not the built-in 480 images at 320 px
    proc = subprocess.run([sys.executable, str(EXAMPLES / "shards_s3.py"), "--bucket", "example-shards", "--data",
                           str(data), "--imgsz", "64", "--epochs", "2", "--batch", "8", "--workers", "1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert re.search(r"train: \d+ images in \d+ shards at s3://example-shards/shapes", out)
    assert "stopped after 1 epoch(s)" in out and "resumed to epoch 2" in out and "unreadable shards 0" in out
    chunks = [k["Key"] for k in s3_env.client().list_objects_v2(Bucket="example-shards")["Contents"]]
    assert any(k.startswith("shapes/train/chunk-") for k in chunks)
    assert any((tmp_path / "cache" / "shards").rglob("chunk-*.bin"))      # streamed through the local cache
    assert s3_env.env["AWS_SECRET_ACCESS_KEY"] not in (tmp_path / "runs" / "shards" / "config.yaml").read_text()
