"""Training from shards in a real S3-compatible store (SeaweedFS on loopback): exact resume mid-epoch, one
and two processes taking the same steps over uneven chunks, and the store's faults (stopped mid-epoch, a
corrupt chunk), each through the real entry point where the user would meet it."""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import _train_workers as workers
import pytest
import torch

from yolokit.accel.launcher import launch
from yolokit.data import make_shapes
from yolokit.testing import assert_weights_equal
from yolokit.train import TrainConfig, Trainer
from yolokit.train.checkpoint import load_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clean_env", "forked_ranks"),
              pytest.mark.skipif(importlib.util.find_spec("litdata") is None, reason="needs yolokit[stream]")]


@pytest.fixture(scope="module")
def store(s3_store, tmp_path_factory):
    """The session's store, its variables set for this module (spawned ranks inherit them), a private cache."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {**s3_store.env, "YOLOKIT_CACHE": str(tmp_path_factory.mktemp("cache"))}.items():
            mp.setenv(k, v)
        yield s3_store


def _shards(store, root: Path, bucket: str, **shapes) -> str:
    from yolokit.data.store.shards import write_shards

    url = store.bucket(bucket) + "/set"
    write_shards(make_shapes(root / "set", imgsz=64, **shapes), url, chunk_bytes="6KB")
    return url


def config(data, out, **kw) -> TrainConfig:
    base = dict(data=data, imgsz=64, batch=2, nbs=6, epochs=3, workers=0, out=str(out), plots=False,
                warmup_epochs=1.0, close_mosaic=1, mosaic_buffer=0, seed=3, optimizer="SGD", lr0=0.01,
                save_period_iters=2)
    return TrainConfig(**{**base, **kw})


def _secrets_in(run: Path, secret: str) -> list[str]:
    return [str(p) for p in run.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def test_a_run_from_the_store_stopped_mid_epoch_resumes_bit_for_bit(store, tmp_path):
    url = _shards(store, tmp_path, "train-resume", seed=4, n_train=13, n_val=4)
    reference = tmp_path / "reference"
    Trainer(config(url, reference)).fit()
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="simulated crash"):
        workers.fit_until(config(url, out), at=12)           # in step 5 of 9: last.pt is step 4's, mid-epoch 2
    state = load_checkpoint(out / "weights" / "last.pt")
    assert (state["epoch"], state["step_in_epoch"], state["steps"]) == (1, 1, 4)
    Trainer(TrainConfig(resume=str(out))).fit()
    a, b = load_checkpoint(reference / "weights" / "last.pt"), load_checkpoint(out / "weights" / "last.pt")
    assert a["steps"] == b["steps"] == 9
    assert_weights_equal(a["model"], b["model"])
    assert_weights_equal(a["ema"]["module"], b["ema"]["module"])
    assert workers.timeless_rows(out) == workers.timeless_rows(reference)
    assert "lost_images" in workers.timeless_rows(out)[0]
    for run in (reference, out):       # no credential reaches config.yaml, results, checkpoints
        assert _secrets_in(run, store.env["AWS_SECRET_ACCESS_KEY"]) == []
        assert _secrets_in(run, store.env["AWS_ACCESS_KEY_ID"]) == []


def test_two_processes_see_every_image_once_and_take_the_steps_of_one(store, tmp_path):
    url = _shards(store, tmp_path, "train-ranks", seed=5, n_train=25, n_val=6)
    cfg = dict(nbs=12, epochs=2, warmup_bias_lr=0.0, save_period_iters=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = workers.fit_recording_images(config(url, tmp_path / "one", **cfg))
    finally:
        torch.set_num_threads(threads)
    two = launch(workers.fit_recording_images, 2, config(url, tmp_path / "two", batch=4, **cfg), timeout=600)
    assert len(one["steps"]) == 6 and [len(r["steps"]) for r in two] == [6, 6]   # 25 images: 3 steps an epoch
    for epoch in range(2):
        steps = range(3 * epoch, 3 * epoch + 3)
        seen = sorted(i for s in steps for r in two for i in r["steps"][s])
        assert seen == list(range(25)) == sorted(i for s in steps for i in one["steps"][s])
        for s in steps:                # the same images in each step, shared out between the ranks
            assert sorted(two[0]["steps"][s] + two[1]["steps"][s]) == sorted(one["steps"][s])
    assert two[0]["digests"] == two[1]["digests"]              # the ranks hold the same weights after every step
    a = load_checkpoint(tmp_path / "one" / "weights" / "last.pt")
    b = load_checkpoint(tmp_path / "two" / "weights" / "last.pt")
    assert max(workers.relative(b["model"][k], v) for k, v in a["model"].items()) < 1e-3


def _train_cli(url: str, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "yolokit", "train", "--data", url, "--imgsz", "64", "--batch",
                             "2", "--nbs", "2", "--epochs", "1", "--workers", "1", "--no-plots", "--out", str(out),
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_the_store_stopped_mid_epoch_ends_in_one_line_with_its_checkpoint_intact(tmp_path):
    from s3store import SeaweedS3, weed_binary

    if weed_binary() is None:
        pytest.skip("needs SeaweedFS's `weed`")

    store = SeaweedS3(tmp_path / "store").start()          # its own store: this test stops it
    try:
        with pytest.MonkeyPatch.context() as mp:
            # two attempts of each request (0.5 s apart), not four (3.5 s): the same fault path, 10 s sooner
            for k, v in {**store.env, "YOLOKIT_CACHE": str(tmp_path / "cache"), "YOLOKIT_STORE_RETRIES": "2"}.items():
                mp.setenv(k, v)
            url = _shards(store, tmp_path, "stopping", seed=6, n_train=40, n_val=4)   # 20 chunks or so
            out = tmp_path / "run"
            proc = _train_cli(url, out, "--save-period-iters", "1")
            last = out / "weights" / "last.pt"
            deadline = time.monotonic() + 300
            while not last.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            store.stop()
            _, err = proc.communicate(timeout=300)
            errors = [line for line in err.splitlines() if "error:" in line]
            assert proc.returncode == 1, err[-3000:]
            assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
            assert "the store did not answer after 2 tries" in errors[0] and "chunk-0-" in errors[0]
            assert f"yolokit train --resume {out}" in errors[0]
            state = load_checkpoint(last)                   # intact, at the last step taken
            assert 1 <= state["steps"] < 20 and state["epoch"] == 0
            # its resume is a mid-epoch resume from shards: test_a_run_from_the_store_stopped_mid_epoch_resumes_
            # bit_for_bit above, and after a stopped store on two processes the extended test below
    finally:
        store.stop()


@pytest.mark.extended   # three runs of two processes each
def test_two_processes_and_a_stopped_store_end_in_one_line_at_a_common_step_and_resume_bit_for_bit(tmp_path):
    """Under two processes (gloo) a store stopped mid-epoch: one error line, no traceback, no process left;
    last.pt at the last step both ranks finished, so the resumed run equals one that never stopped."""
    from _processes import alive, descendants
    from s3store import SeaweedS3, weed_binary

    if weed_binary() is None:
        pytest.skip("needs SeaweedFS's `weed`")
    store = SeaweedS3(tmp_path / "store").start()
    try:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in store.env.items():
                mp.setenv(k, v)
            url = _shards(store, tmp_path, "stopping-ranks", seed=8, n_train=40, n_val=6)
            common = ("--devices", "2", "--mosaic-buffer", "0", "--save-period-iters", "1")
            mp.setenv("YOLOKIT_CACHE", str(tmp_path / "cache-reference"))
            reference = _train_cli(url, tmp_path / "reference", *common)
            _, err = reference.communicate(timeout=600)
            assert reference.returncode == 0, err[-3000:]
            mp.setenv("YOLOKIT_CACHE", str(tmp_path / "cache"))
            out = tmp_path / "run"
            proc = _train_cli(url, out, *common)
            last = out / "weights" / "last.pt"
            deadline = time.monotonic() + 300
            while not last.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            below = descendants(proc.pid)                 # the two ranks and their loader workers
            store.stop()
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 1, err[-3000:]
            errors = [line for line in err.splitlines() if "error:" in line]
            assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
            assert "the store did not answer" in errors[0] and f"yolokit train --resume {out}" in errors[0]
            deadline = time.monotonic() + 10              # workers end right after their parent
            while alive(below) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert len(below) >= 2 and not alive(below), below
            state = load_checkpoint(last)
            assert 1 <= state["steps"] < 20 and state["epoch"] == 0 and errors[0].count(f"step {state['steps']}")
            store.start()
            resumed = subprocess.run([sys.executable, "-m", "yolokit", "train", "--resume", str(out)],
                                     capture_output=True, text=True, timeout=600)
            assert resumed.returncode == 0, resumed.stderr[-3000:]
            a, b = load_checkpoint(tmp_path / "reference" / "weights" / "last.pt"), load_checkpoint(last)
            assert a["steps"] == b["steps"] == 20
            assert_weights_equal(a["model"], b["model"])
            assert_weights_equal(a["ema"]["module"], b["ema"]["module"])
    finally:
        store.stop()


def test_a_corrupt_chunk_is_named_skipped_and_counted_in_results(store, tmp_path):
    url = _shards(store, tmp_path, "corrupt", seed=7, n_train=16, n_val=4)
    client, key = store.client(), "set/train/chunk-0-2.bin"
    size = client.head_object(Bucket="corrupt", Key=key)["ContentLength"]
    client.put_object(Bucket="corrupt", Key=key, Body=b"\0" * 16 + b"\x07" * (size - 16))   # same size, garbage
    out = tmp_path / "run"
    proc = _train_cli(url, out)
    stdout, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    named = [line for line in err.splitlines() if "chunk-0-2.bin is unreadable" in line]
    assert len(named) == 1 and "skipped" in named[0]
    lost = int(named[0].split("its ")[1].split(" image")[0])
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert int(float(rows[-1]["lost_images"])) == lost > 0
    assert f"{lost} images of unreadable shards skipped" in stdout + err
    assert "cache=" in err and "/25.0G" in err            # the local chunk cache against its cap, as it fills
    assert os.path.exists(out / "weights" / "last.pt")
