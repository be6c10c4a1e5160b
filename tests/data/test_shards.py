"""Shards on a local disk: written from a folder or COCO, read back item for item, written again after a
stop, and read past a corrupt or cut-short chunk (the object-store cases are in test_shards_s3.py)."""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from yolokit.data import DetectionDataset, ShardedBatchSampler, build_dataloader, make_shapes
from yolokit.data.sources.readers import load_split
from yolokit.data.sources.selection import select

pytestmark = pytest.mark.skipif(importlib.util.find_spec("litdata") is None, reason="needs yolokit[stream]")

CHUNK = "6KB"       # 64-pixel shapes JPEGs: 2 to 5 images a chunk, so chunks are uneven


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    return make_shapes(tmp_path_factory.mktemp("shapes") / "set", seed=1, n_train=25, n_val=7, imgsz=64)


@pytest.fixture(scope="module")
def shards(shapes, tmp_path_factory) -> Path:
    from yolokit.data.store.shards import write_shards

    out = tmp_path_factory.mktemp("shards") / "out"
    write_shards(shapes, out, chunk_bytes=CHUNK)
    return out


def _content(root: Path) -> dict[str, list]:
    """Every split's items in order: key, the image's bytes and its labels (chunk boundaries may differ:
    litdata cuts chunks by the bytes it counts since a writer started)."""
    out = {}
    for split in ("train", "val"):
        index = load_split(root, split)
        out[split] = [(index.paths.key(i), index.image_bytes(i).tobytes(), index.labels[i].tobytes(),
                       tuple(index.shapes[i])) for i in range(len(index))]
    return out


def test_shards_hold_every_image_and_label_of_the_folder(shapes, shards):
    manifest = json.loads((shards / "yolokit-shards.json").read_text())
    for split, n in (("train", 25), ("val", 7)):
        folder, sharded = load_split(shapes, split), load_split(shards, split)
        assert len(folder) == len(sharded) == n == manifest["splits"][split]["images"]
        chunks = json.loads((shards / split / "index.json").read_text())["chunks"]
        sizes = [c["chunk_size"] for c in chunks]
        assert sum(sizes) == n and len(chunks) == manifest["splits"][split]["chunks"]
        if split == "train":
            assert len(chunks) >= 5 and len(set(sizes)) > 1                  # several, uneven chunks
        assert sharded.names == folder.names == manifest["names"]
        np.testing.assert_array_equal(sharded.shapes, folder.shapes)
        for i in range(n):
            np.testing.assert_array_equal(sharded.labels[i], folder.labels[i])
            assert sharded.image_bytes(i).tobytes() == Path(folder.paths[i]).read_bytes()   # as on disk
            assert sharded.paths[i] == f"{shards}/{split}/images/{split}/{Path(folder.paths[i]).name}"
        assert sharded.groups.tolist() == np.repeat(np.arange(len(sizes)), sizes).tolist()
    # the data.yaml written beside them trains like the folder, and so does the folder of shards itself
    a, b = DetectionDataset(shapes, "val", imgsz=64), DetectionDataset(shards / "data.yaml", "val", imgsz=64)
    c = DetectionDataset(shards, "val", imgsz=64, rect=True)
    assert len(DetectionDataset(shards / "val", "val", imgsz=64)) == 7          # one split's own folder
    with pytest.raises(FileNotFoundError, match=r"holds the shards of one split \(train\), not of 'val'"):
        DetectionDataset(shards / "train", "val", imgsz=64)                    # would validate on train
    for i in range(len(a)):
        assert torch.equal(a[i]["image"], b[i]["image"]) and torch.equal(a[i]["boxes"], b[i]["boxes"])
        assert a[i]["ratio_pad"] == b[i]["ratio_pad"] and c[i]["image"].shape[1:] == (64, 64)


def test_a_coco_json_keeps_its_category_and_image_ids(shapes, tmp_path):
    from yolokit.data.store.shards import write_shards

    folder = load_split(shapes, "val")
    images, anns = [], []
    for i, (p, (h, w), lab) in enumerate(zip(folder.paths, folder.shapes, folder.labels, strict=True)):
        images.append({"id": 50 + i, "file_name": Path(p).name, "height": int(h), "width": int(w)})
        anns += [{"id": len(anns) + 1, "image_id": 50 + i, "category_id": [2, 4, 6, 8][int(c)],
                  "bbox": [x1, y1, x2 - x1, y2 - y1], "iscrowd": 0} for c, x1, y1, x2, y2 in lab.tolist()]
    cats = [{"id": c, "name": n} for c, n in zip([2, 4, 6, 8], folder.names, strict=True)]
    (tmp_path / "instances_val.json").write_text(json.dumps({"images": images, "annotations": anns,
                                                             "categories": cats}))
    out = tmp_path / "coco-shards"
    summary = write_shards(tmp_path / "instances_val.json", out, splits=["val"], image_dir=Path(folder.paths[0]).parent)
    assert summary["val"].images == 7
    sharded = DetectionDataset(out, "val", imgsz=64)
    assert sharded.category_ids == [2, 4, 6, 8] and sharded.image_ids == [50 + i for i in range(7)]
    for i in range(7):
        np.testing.assert_allclose(sharded.index.labels[i], folder.labels[i], atol=1e-4)


def test_writing_again_continues_a_stopped_write_and_ends_with_the_same_files(shapes, shards, tmp_path,
                                                                              monkeypatch):
    from yolokit.data.store import remote
    from yolokit.data.store.shards import write_shards

    out, calls = tmp_path / "out", {"n": 0}
    original = remote.Place.put_file

    def stopping(self, name, local):
        calls["n"] += 1
        if calls["n"] == 4:                       # the 4th chunk of train: Ctrl-C while it is copied
            raise KeyboardInterrupt
        return original(self, name, local)

    monkeypatch.setattr(remote.Place, "put_file", stopping)
    with pytest.raises(KeyboardInterrupt):
        write_shards(shapes, out, chunk_bytes=CHUNK)
    monkeypatch.undo()
    progress = json.loads((out / "train" / "progress.json").read_text())
    assert len(progress["chunks"]) == 3 and not (out / "train" / "index.json").exists()
    with pytest.raises(FileNotFoundError, match="no finished shards"):    # a half write is not trained on
        load_split(out, "train")
    done = sum(c["chunk_size"] for c in progress["chunks"])
    summary = write_shards(shapes, out, chunk_bytes=CHUNK)
    assert summary["train"].written == 25 - done and summary["val"].written == 7
    assert _content(out) == _content(shards)
    assert write_shards(shapes, out, chunk_bytes=CHUNK)["train"].written == 0       # complete: nothing to do
    assert not list(out.rglob("parts/*.npz"))                  # the labels of each chunk are in labels.npz now
    for name in ("yolokit-shards.json", "train/index.json", "train/labels.npz", "train/chunk-0-0.bin"):
        assert (out / name).stat().st_mode & 0o044 == 0o044, name   # readable by others, as files written here are


def test_a_chunk_cut_short_is_named_and_written_again(shapes, shards, tmp_path, caplog):
    from yolokit.data.store.shards import write_shards

    out = tmp_path / "out"
    shutil.copytree(shards, out)
    chunk = out / "train" / "chunk-0-2.bin"
    chunk.write_bytes(chunk.read_bytes()[:100])          # a copy that stopped
    with caplog.at_level(logging.WARNING, "yolokit.data"):
        summary = write_shards(shapes, out, chunk_bytes=CHUNK)
    cut = [p for p in summary["train"].problems if "cut short" in p.reason]
    assert len(cut) == 1 and cut[0].path.endswith("chunk-0-2.bin") and "(100 of" in cut[0].reason
    assert "chunk-0-2.bin" in caplog.text and summary["train"].written > 0
    assert _content(out) == _content(shards)


def test_an_unreadable_source_image_is_named_and_counted(shapes, tmp_path):
    from yolokit.data.store.shards import write_shards

    src = tmp_path / "src"
    shutil.copytree(shapes.parent, src)
    text = (src / "data.yaml").read_text().splitlines()
    (src / "data.yaml").write_text("\n".join(["path: ."] + [t for t in text if not t.startswith("path:")]))
    bad = sorted((src / "images" / "val").iterdir())[3]
    bad.write_bytes(bad.read_bytes()[:40])                # a JPEG cut short
    out = tmp_path / "out"
    summary = write_shards(src / "data.yaml", out, chunk_bytes=CHUNK)
    left = [p for p in summary["val"].problems if p.action == "excluded"]
    assert [Path(p.path).name for p in left] == [bad.name]
    manifest = json.loads((out / "yolokit-shards.json").read_text())
    assert manifest["splits"]["val"]["left_out"] == 1 and summary["val"].images == 6
    assert any(bad.name in p[0] for p in manifest["splits"]["val"]["problems"])


def test_a_corrupt_or_cut_short_chunk_is_skipped_named_once_and_counted(shards, tmp_path, caplog):
    out = tmp_path / "out"
    shutil.copytree(shards, out)
    garbage = out / "train" / "chunk-0-1.bin"
    garbage.write_bytes(bytes(16) + b"\xff" * (garbage.stat().st_size - 16))   # same size, garbage items
    short = out / "train" / "chunk-0-3.bin"
    short.write_bytes(short.read_bytes()[:-10])          # litdata alone would wait for the rest for ever
    ds = DetectionDataset(out, "train", imgsz=64)
    groups = ds.index.groups
    with caplog.at_level(logging.WARNING, "yolokit.data"):
        items = [ds[i] for i in range(len(ds))]
    lost = np.isin(groups, [1, 3])
    for i, item in enumerate(items):
        assert (item["index"] != i) == lost[i]           # a lost chunk's images are replaced by readable ones
        assert not lost[item["index"]]
    assert ds.index.store.lost_images == int(lost.sum()) > 0
    assert ds.index.store.lost_chunks() == [1, 3]
    assert caplog.text.count("chunk-0-1.bin is unreadable") == 1 and caplog.text.count("chunk-0-3.bin") == 1
    # the loader's workers share what they found with the main process
    ds2 = DetectionDataset(out, "train", imgsz=64)
    seen = [i for batch in build_dataloader(ds2, 5, workers=2, shuffle=False) for i in batch["indices"]]
    assert len(seen) == 25 and ds2.index.store.lost_images == int(lost.sum())


def test_the_order_visits_chunk_by_chunk_and_is_one_over_all_ranks(shards):
    groups = load_split(shards, "train").groups
    one = ShardedBatchSampler(25, 3, accumulate=2, seed=5, groups=groups)
    one.set_epoch(2)
    order = one.order()
    assert sorted(order.tolist()) == list(range(25))
    runs = [g for k, g in enumerate(groups[order].tolist()) if k == 0 or g != groups[order[k - 1]]]
    assert sorted(runs) == sorted(set(runs))              # each chunk's images together
    assert runs != sorted(runs)                           # in a seeded order of chunks
    one.set_epoch(3)
    assert one.order().tolist() != order.tolist()
    one.set_epoch(2)
    flat = [b for b in one]
    for world in (2, 3):                                  # every rank's share: the same images, step by step
        ranks = []
        for r in range(world):
            s = ShardedBatchSampler(25, 3, rank=r, world_size=world, accumulate=1, seed=5, groups=groups)
            s.set_epoch(2)
            ranks.append(list(s))
        padded = [r + [[]] * (len(ranks[0]) - len(r)) for r in ranks]
        merged = [b for step in zip(*padded, strict=True) for b in step if b]
        assert sorted(i for b in merged for i in b) == list(range(25))
        assert [i for b in merged for i in b] == [i for b in flat for i in b]


def test_mosaic_partners_and_selection_stay_within_the_shards(shards):
    ds = DetectionDataset(shards, "train", imgsz=64, augment=True, buffer_size=0)
    rng = np.random.default_rng(0)
    g = ds.index.groups
    for i in range(len(ds)):
        assert all(g[j] == g[i] for j in ds._partners(rng, i)) and g[int(ds._anywhere(rng, i))] == g[i]
    assert ds[3]["image"].shape == (3, 64, 64)
    index, _ = select(ds.index, fraction=0.5, seed=1)
    assert len(index) == 12 and index.store is ds.index.store
    for k in range(len(index)):                            # a subset still reads each image's own bytes
        j = int(index.items[k])
        assert index.image_bytes(k).tobytes() == ds.index.image_bytes(j).tobytes()
        np.testing.assert_array_equal(index.labels[k], ds.index.labels[j])


@pytest.mark.parametrize("cache", ["ram", "disk"])
def test_the_image_caches_hold_the_shards_images(shards, cache):
    plain = DetectionDataset(shards, "train", imgsz=64, augment=True, buffer_size=0)
    cached = DetectionDataset(shards, "train", imgsz=64, augment=True, buffer_size=0, cache_images=cache)
    for i in (0, 7, 24):
        a, b = plain[i], cached[i]
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["boxes"], b["boxes"])
    if cache == "disk":
        files = {cached._disk.file(i) for i in range(len(cached))}
        assert len(files) == 25 and all(f.is_file() for f in files)   # one file per image, keyed by its chunk
        again = DetectionDataset(shards, "train", imgsz=64, cache_images="disk")
        assert {again._disk.file(i) for i in range(25)} == files


def test_the_device_augmentation_makes_the_workers_labels_from_shards(shards):
    from yolokit.data.augment.device_augment import augment_batch

    batches = {}
    for augment_on in ("workers", "device"):
        ds = DetectionDataset(shards, "train", imgsz=64, augment=True, hyp=None)
        loader = build_dataloader(ds, 8, workers=0, seed=2, uint8_images=True, augment_on=augment_on)
        batches[augment_on] = next(iter(loader))
    a, b = batches["workers"], batches["device"]
    assert torch.equal(a["targets"], b["targets"]) and a["indices"] == b["indices"]
    images = augment_batch(b, "cpu")
    assert (images.int() - a["images_uint8"].int()).abs().float().mean((1, 2, 3)).max() <= 1.0


def test_predict_reads_a_split_of_shards_named_by_its_keys(shapes, shards):
    from yolokit.predict.sources import frames

    folder = load_split(shapes, "val")
    seen = list(frames(str(shards / "val")))
    assert [f.name for f in seen] == [f"images/val/{Path(p).name}" for p in folder.paths]
    files = list(frames(str(Path(folder.paths[0]).parent)))
    assert all(torch.equal(a.image, b.image) for a, b in zip(seen, files, strict=True))
    with pytest.raises(FileNotFoundError, match="name one, e.g."):
        list(frames(str(shards)))


def test_ctrl_c_stops_yolokit_data_shard_in_one_line_and_the_same_command_continues(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    src = make_shapes(tmp_path / "set", seed=3, n_train=300, n_val=4, imgsz=160)
    out = tmp_path / "out"      # a chunk of one or two images: ~200 commits, seconds of work to stop in
    cmd = [sys.executable, "-m", "yolokit", "data", "shard", str(src), str(out), "--chunk-bytes", "6KB"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    progress = out / "train" / "progress.json"
    deadline = time.monotonic() + 120
    while not progress.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == ("yolokit data: stopped by SIGINT: the same command continues where "
                                            "it stopped") and "Traceback" not in err, err[-2000:]
    done = sum(c["chunk_size"] for c in json.loads(progress.read_text())["chunks"])
    assert 0 < done < 300, err[-2000:]
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "train: 300 images in" in again.stdout and f"({300 - done} written now)" in again.stdout, \
        (done, again.stdout, again.stderr[-2000:])
    assert len(load_split(out, "train")) == 300


def test_a_failed_litdata_thread_prints_no_traceback_others_do(monkeypatch, capfd, caplog):
    """litdata's chunk download thread dies when the store stops; the read waiting for it says so in one
    line, so the thread's own traceback is left out (seen once in a full run: 'Traceback' beside the one
    line). A thread of anyone else still goes to the hook before (which prints its traceback)."""
    import threading

    from yolokit.data.store.remote import quiet_litdata_threads

    reached = []
    monkeypatch.setattr(threading, "excepthook", lambda args: reached.append(args.thread.name))
    quiet_litdata_threads()
    quiet_litdata_threads()                                             # once: not wrapped twice

    def boom():
        raise RuntimeError("Generic S3 error: HTTP error: error sending request")

    class PrepareChunksThread(threading.Thread):
        pass

    PrepareChunksThread.__module__ = "litdata.streaming.reader"
    for thread in (PrepareChunksThread(target=boom, name="litdata's"), threading.Thread(target=boom, name="theirs")):
        thread.start()
        thread.join()
    assert reached == ["theirs"]

    # litdata 0.2.76's chunk thread catches its own error, keeps it for the read, and printed its traceback
    # itself (a full run saw it from a loader worker): now one debug line
    from litdata.streaming.reader import PrepareChunksThread as Real

    capfd.readouterr()
    with caplog.at_level(logging.DEBUG, logger="yolokit"):
        try:
            boom()
        except RuntimeError as exc:
            Real._report_crash(object(), exc)
    assert capfd.readouterr().err == ""
    assert "litdata's chunk thread stopped: RuntimeError: Generic S3 error" in caplog.text


def test_the_built_in_set_is_a_source_by_its_name(shapes, monkeypatch):
    """``yolokit data shard shapes OUT`` writes the built-in set: "shapes" resolves to its data.yaml
    (generated on first use), every split it has."""
    import yolokit.data.sources.shapes
    from yolokit.data.store.shards import _splits_of

    monkeypatch.setattr(yolokit.data.sources.shapes, "make_shapes", lambda: shapes)   # the module's small set
    splits, root, coco = _splits_of("shapes", None)
    assert splits == ["train", "val"] and not coco and Path(root) == shapes.parent
    assert _splits_of("shapes", ["val"])[0] == ["val"]


def test_validation_samples_from_shards_show_the_images(shapes, tmp_path):
    """The sample plots' images come from the shards themselves (by index), not from the paths of the files
    they were written from: with those files gone, the samples are still the original pixels."""
    import cv2

    import yolokit
    from yolokit.data.store.shards import write_shards
    from yolokit.val import validate

    source = tmp_path / "source"
    shutil.copytree(shapes.parent, source)
    write_shards(source / shapes.name, tmp_path / "shards", chunk_bytes=CHUNK, splits=["val"])
    shutil.rmtree(source)                                     # the files the shards came from are gone
    dataset = DetectionDataset(str(tmp_path / "shards"), "val", imgsz=64, rect=True)
    loader = build_dataloader(dataset, 4, workers=0, shuffle=False)
    torch.manual_seed(0)
    model = yolokit.create_model("yolov8n", num_classes=len(dataset.names)).eval()
    _, samples = validate(model, loader, num_classes=len(dataset.names), keep_samples=7)
    assert len(samples) == 7
    originals = {p.name: cv2.imread(str(p))[..., ::-1] for p in (shapes.parent / "images" / "val").glob("*.jpg")}
    for image, _, _ in samples:
        assert any(image.shape == o.shape and np.array_equal(image, o) for o in originals.values())
        assert not (image == 114).all()                        # not the grey stand-in


def test_reading_shards_without_the_engine_names_the_extra(shards, monkeypatch):
    from yolokit.data.store.stream import shard_index

    monkeypatch.setitem(sys.modules, "litdata", None)       # as without yolokit[stream]
    with pytest.raises(ImportError, match=r"pip install 'yolokit\[stream\]'"):
        shard_index(shards / "train")


def test_the_store_retries_come_from_the_environment(monkeypatch):
    """``$YOLOKIT_STORE_RETRIES`` sets each S3 request's attempts (4 unset); a bad value names the variable.
    (tests/train/test_train_shards.py runs a stopped store with 2; its error line says so.)"""
    from yolokit.data.store.remote import Place

    monkeypatch.delenv("YOLOKIT_STORE_RETRIES", raising=False)
    assert Place("s3://bucket/set").retries == 4 and Place("s3://bucket/set", retries=7).retries == 7
    monkeypatch.setenv("YOLOKIT_STORE_RETRIES", "2")
    assert Place("s3://bucket/set").retries == 2
    for bad in ("0", "two"):
        monkeypatch.setenv("YOLOKIT_STORE_RETRIES", bad)
        with pytest.raises(ValueError, match=f"YOLOKIT_STORE_RETRIES must be .* got '{bad}'"):
            Place("s3://bucket/set")
