"""Shards in a real S3-compatible store (SeaweedFS on loopback, the `s3_env` fixture): written, read back
item for item through litdata's cache, named by a local data.yaml, and refused credentials in one line."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from yolokit.data import DetectionDataset, build_dataloader, make_shapes
from yolokit.data.sources.readers import load_split

pytestmark = pytest.mark.skipif(importlib.util.find_spec("litdata") is None, reason="needs yolokit[stream]")


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    return make_shapes(tmp_path_factory.mktemp("shapes") / "set", seed=2, n_train=20, n_val=6, imgsz=64)


def test_shards_written_to_the_store_read_back_as_the_folder(shapes, s3_env, tmp_path):
    from yolokit.data.store.shards import write_shards

    url = s3_env.bucket("shards-roundtrip") + "/set"
    summary = write_shards(shapes, url, chunk_bytes="8KB")
    assert summary["train"].images == 20 and summary["train"].chunks > 2 and summary["val"].images == 6
    keys = {o["Key"] for o in s3_env.client().list_objects_v2(Bucket="shards-roundtrip")["Contents"]}
    assert {"set/yolokit-shards.json", "set/data.yaml", "set/train/index.json", "set/train/labels.npz",
            "set/val/chunk-0-0.bin"} <= keys
    assert write_shards(shapes, url, chunk_bytes="8KB")["train"].written == 0        # complete already

    folder, sharded = load_split(shapes, "train"), load_split(url, "train")
    assert sharded.paths[4] == f"{url}/train/images/train/{Path(folder.paths[4]).name}"
    for i in range(len(folder)):
        assert sharded.image_bytes(i).tobytes() == Path(folder.paths[i]).read_bytes()
        np.testing.assert_array_equal(sharded.labels[i], folder.labels[i])
    cache = Path(os.environ["YOLOKIT_CACHE"]) / "shards"
    assert sharded.store.cache_bytes() >= sum(sharded.store.nbytes) and cache.is_dir()   # whole chunks, cached

    # a local data.yaml whose splits are in the store; the loader's workers read them too
    (tmp_path / "data.yaml").write_text(f"train: {url}/train\nval: {url}/val\nnames: {json.dumps(folder.names)}\n")
    a = DetectionDataset(shapes, "val", imgsz=64)
    b = DetectionDataset(tmp_path / "data.yaml", "val", imgsz=64)
    for i in range(len(a)):
        assert torch.equal(a[i]["image"], b[i]["image"]) and torch.equal(a[i]["boxes"], b[i]["boxes"])
    train = DetectionDataset(url, "train", imgsz=64, augment=True)
    seen = [i for batch in build_dataloader(train, 6, workers=2, seed=1) for i in batch["indices"]]
    assert sorted(seen) == list(range(20)) and train.index.store.lost_images == 0


def _cli(*args, env, timeout=120):
    return subprocess.run([sys.executable, "-m", "yolokit", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_wrong_credentials_are_one_line_and_exit_2_before_any_work(shapes, s3_env, tmp_path):
    from yolokit.data.store.shards import write_shards

    url = s3_env.bucket("shards-credentials") + "/set"
    write_shards(shapes, url, chunk_bytes="8KB", splits=["val"])
    env = {**os.environ, "AWS_SECRET_ACCESS_KEY": "not-the-secret-at-all"}
    for args in (["data", "shard", str(shapes), url + "2"],
                 ["train", "--data", url, "--imgsz", "64", "--epochs", "1", "--out", str(tmp_path / "run")]):
        done = _cli(*args, env=env)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2, done.stderr[-2000:]
        assert len(lines) == 1 and "refused the credentials" in lines[0], done.stderr[-2000:]
        assert "not-the-secret-at-all" not in done.stdout + done.stderr
    assert not (tmp_path / "run").exists()                # before training: no run folder at all
    env.pop("AWS_SECRET_ACCESS_KEY")
    env.pop("AWS_ACCESS_KEY_ID")
    done = _cli("data", "shard", str(shapes), url, env={**env, "HOME": str(tmp_path)})
    assert done.returncode == 2 and "no S3 credentials" in done.stderr


def test_a_bucket_that_does_not_exist_is_named_with_how_to_make_it(shapes, s3_env, tmp_path, capsys):
    """``yolokit data shard`` (and ``train``) with a missing bucket: one line that says the bucket must exist
    and how to make it (yolokit creates no bucket), exit 2, nothing written."""
    from yolokit.cli import main

    url = "s3://no-such-bucket-here/set"
    for args in (["data", "shard", str(shapes), url], ["train", "--data", url, "--out", str(tmp_path / "run")]):
        capsys.readouterr()
        assert main(args) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1, lines
        assert "s3://no-such-bucket-here: no such bucket; create it first (aws s3 mb s3://no-such-bucket-here" \
            in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_predict_from_the_store_saves_the_real_images(shapes, s3_env, tmp_path):
    """`yolokit predict s3://.../val` (shards): each saved image is the stored image itself (no box passes
    --conf 0.999 of a fresh model), named by its key; an s3:// prefix of plain image files reads the same."""
    import cv2

    from yolokit.data.store.shards import write_shards
    from yolokit.predict.sources import frames

    url = s3_env.bucket("predict-from-store") + "/set"
    write_shards(shapes, url, chunk_bytes="8KB", splits=["val"])
    originals = sorted((shapes.parent / "images" / "val").iterdir())
    client = s3_env.client()
    for path in originals[:3]:                                  # plain files under another prefix
        client.put_object(Bucket="predict-from-store", Key=f"loose/a/{path.name}", Body=path.read_bytes())
    client.put_object(Bucket="predict-from-store", Key="loose/notes.txt", Body=b"not an image")
    out = tmp_path / "predicted"
    done = _cli("predict", f"{url}/val", "--num-classes", "3", "--imgsz", "64", "--conf", "0.999", "--out", str(out),
                env=os.environ.copy())
    assert done.returncode == 0, done.stderr[-2000:]
    saved = sorted(str(p.relative_to(out)) for p in out.rglob("*.jpg"))
    assert saved == [f"images/val/{p.name}" for p in originals], saved
    for name, original in zip(saved, originals, strict=True):
        got, want = cv2.imread(str(out / name)), cv2.imread(str(original))
        assert got.shape == want.shape and np.abs(got.astype(int) - want).mean() < 4     # a JPEG re-encoded
        assert np.abs(got.astype(int) - 114).mean() > 20                              # not a grey canvas
    loose = list(frames("s3://predict-from-store/loose"))             # what predict reads from a plain prefix
    assert [f.name for f in loose] == [f"a/{p.name}" for p in originals[:3]]
    for frame, original in zip(loose, originals[:3], strict=True):
        assert frame.path == f"s3://predict-from-store/loose/a/{original.name}"
        assert torch.equal(frame.image, next(iter(frames(str(original)))).image)
    with pytest.raises(FileNotFoundError, match="no shards and no images there"):
        list(frames("s3://predict-from-store/nothing-here"))
