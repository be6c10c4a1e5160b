"""Image caches: one shared copy in RAM per machine, files on disk reused across runs; both give
exactly the images and boxes an uncached dataset gives."""

from __future__ import annotations

import os
import time

import _cache_workers as workers
import cv2
import numpy as np
import pytest
import torch

from yolokit.accel.launcher import launch
from yolokit.data import DetectionDataset, ImageError, make_shapes
from yolokit.data.store.cache import DiskCache, RamCache, resized_shape


@pytest.mark.parametrize("augment", [True, False])
def test_ram_and_disk_caches_give_the_uncached_items(shapes_yaml, augment):
    kw = dict(imgsz=96, augment=augment, rect=not augment, buffer_size=0)   # 128 px images resized to 96
    split = "train" if augment else "val"
    plain = DetectionDataset(shapes_yaml, split, **kw)
    cached = [DetectionDataset(shapes_yaml, split, cache_images=mode, **kw) for mode in ("ram", True, "disk", "disk")]
    for i in range(len(plain)):
        want = plain[i]
        for other in cached:
            got = other[i]
            assert torch.equal(got["image"], want["image"]) and torch.equal(got["boxes"], want["boxes"])
    assert all(len(d) == len(plain) for d in cached) and cached[0]._ram is not None and cached[2]._disk is not None


def test_resized_shape_is_the_shape_the_dataset_decodes(shapes_yaml):
    dataset = DetectionDataset(shapes_yaml, "val", imgsz=100)
    for i in range(len(dataset)):
        h, w = (int(v) for v in dataset.shapes[i])
        assert resized_shape(h, w, 100) == dataset._read_resized(i).shape[:2]
    assert resized_shape(480, 640, 640) == (480, 640) and resized_shape(480, 640, 320) == (240, 320)


def test_a_cache_that_does_not_fit_is_refused_with_both_figures():
    shapes = np.array([[480, 640]] * 1000)
    with pytest.raises(MemoryError, match=r'cache="ram" needs 922 MB for 1,000 images at imgsz 640, but 500 MB '
                                          r'of RAM are available; use cache="disk"'):
        RamCache(shapes, 640, lambda i: np.zeros((480, 640, 3), np.uint8), available=500_000_000)


def test_the_ram_cache_is_read_only_and_an_unreadable_image_is_tried_again(tmp_path, caplog, monkeypatch):
    import yolokit.data.sources.labels as module

    yaml = make_shapes(tmp_path / "set", n_train=6, n_val=2, imgsz=64)
    plain = DetectionDataset(yaml, "train", imgsz=64)
    with pytest.raises(ValueError, match="read-only"):
        DetectionDataset(yaml, "train", imgsz=64, cache_images="ram").load(0)[0][0, 0, 0] = 1   # never spoilt
    real, path = module.read_bytes, plain.index.paths[3]

    def flaky(p):                                        # image 3 cannot be read, for now
        if str(p) == path and flaky.broken:
            raise ImageError("busy disk")
        return real(p)

    flaky.broken = True
    monkeypatch.setattr(module, "read_bytes", flaky)
    broken = DetectionDataset(yaml, "train", imgsz=64, cache_images="ram")
    assert broken._ram.get(3) is None and broken._ram.get(2) is not None
    assert broken[3]["index"] == 4                      # the next readable image, reported once
    assert "excluded at run time" in caplog.text and path in caplog.text
    flaky.broken = False                                # readable again: read from its file at run time
    assert broken[3]["index"] == 3 and torch.equal(broken[3]["image"], plain[3]["image"])


def test_disk_cache_files_are_reused_and_invalidated_by_size_mtime_and_imgsz(tmp_path):
    yaml = make_shapes(tmp_path / "set", n_train=4, n_val=2, imgsz=64)
    paths = DetectionDataset(yaml, "train", imgsz=64).index.paths
    reads = []

    def read(i):
        reads.append(i)
        image = cv2.imread(paths[i])
        return cv2.resize(image, (48, 48))

    cache = DiskCache(paths, 48, tmp_path / "cache")
    assert cache.fill(range(4), read, progress=False) == 4 and sorted(reads) == [0, 1, 2, 3]
    assert cache.fill(range(4), read, progress=False) == 0 and len(reads) == 4      # reused
    again = DiskCache(paths, 48, tmp_path / "cache")                                 # another run
    assert np.array_equal(again.get(2, read), read(2)) and len(reads) == 5           # that read() is the check's
    first = cache.file(1)
    image = cv2.imread(paths[1])
    cv2.imwrite(paths[1], 255 - image)                   # the image changes: another file name
    os.utime(paths[1], ns=(time.time_ns(), time.time_ns() + 10**9))
    assert cache.file(1) != first and cache.fill(range(4), read, progress=False) == 1
    assert cache.file(1) != DiskCache(paths, 64, tmp_path / "cache").file(1)          # another imgsz
    # a fill killed mid-write leaves a temporary file only, never read; a spoiled file is a miss
    target = cache.file(0)
    (target.parent / f".{target.stem}.123.tmp").write_bytes(b"half")
    target.write_bytes(b"\x93NUMPY spoiled")
    n = len(reads)
    assert np.array_equal(cache.get(0, read), read(0)) and len(reads) == n + 2
    assert np.load(target).shape == (48, 48, 3)          # written again, whole


@pytest.mark.slow
@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.extended)])   # spawn: 23 s
def test_two_processes_with_two_workers_each_hold_one_copy(tmp_path, context):
    yaml = make_shapes(tmp_path / "set", n_train=47, n_val=2, imgsz=320)   # ranks fill 24 and 23
    results = launch(workers.shared_cache, 2, str(yaml), 320, context, timeout=240)
    size = results[0]["bytes"]
    assert size == sum(h * w * 3 for h, w in DetectionDataset(yaml, "train").shapes) > 9e6   # 320 px
    assert [r["processes"] for r in results] == [3, 3]                   # a rank and its 2 workers, twice
    assert results[0]["sums"][0] > 0 and len({s for r in results for s in r["sums"]}) == 1   # all read it all
    rss = [v for r in results for v in r["rss"]]
    assert all(v >= 0.95 * size for v in rss)            # each of the 6 processes has every page mapped
    pss = sum(r["pss"] for r in results)
    assert 0.95 * size <= pss <= 1.1 * size               # ... and together they hold one copy, not 2, 4 or 6
    # whole processes (smaps_rollup), from the filled cache to all 6 having read everything: private copies
    # would add 5 copies; what grows is each process's own heap (numpy temporaries), under one copy here
    assert sum(r["grown"] for r in results) < 1.5 * size
    assert results[0]["left"] == results[1]["left"] == []  # nothing left in /dev/shm, even while running


def test_a_copy_of_a_ram_cached_dataset_holds_its_own_images(shapes_yaml):
    import copy
    import pickle

    dataset = DetectionDataset(shapes_yaml, "val", imgsz=64, cache_images="ram")
    for other in (copy.deepcopy(dataset), pickle.loads(pickle.dumps(dataset))):
        assert other._ram.fd == -1                        # not the shared pages: a private copy
        for i in range(len(dataset)):
            assert torch.equal(other[i]["image"], dataset[i]["image"])


SLOW_FILL = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)   # as in a terminal, even when started from a
from yolokit.data import DetectionDataset                   # background job (which ignores SIGINT)
real = DetectionDataset._read_resized
def slow(self, i):
    time.sleep(0.1)
    print("read", i, flush=True)
    return real(self, i)
DetectionDataset._read_resized = slow
DetectionDataset(sys.argv[1], "train", imgsz=64, cache_images=sys.argv[2])
print("filled", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ram", "disk"])
def test_ctrl_c_during_a_cache_fill_stops_it_at_once(tmp_path, mode):
    """A fill is a thread pool: Ctrl-C must not wait for the images not yet started (it did)."""
    import signal
    import subprocess
    import sys

    from _torchrun_env import subprocess_env

    yaml = make_shapes(tmp_path / "set", n_train=60, n_val=2, imgsz=64)
    env = {**subprocess_env(), "YOLOKIT_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-c", SLOW_FILL, str(yaml), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    for line in proc.stdout:                              # a few images read: the fill is under way
        lines.append(line)
        if sum(x.startswith("read") for x in lines) >= 4:
            break
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    reads = sum(x.startswith("read") for x in lines + rest.splitlines(keepends=True))
    assert proc.returncode != 0 and "KeyboardInterrupt" in rest and "filled" not in rest
    assert reads < 30, f"{reads} of 60 images read after Ctrl-C"  # a thread pool's few running reads, not all


def test_two_ranks_creating_the_cache_at_once_share_the_first_file(tmp_path, monkeypatch):
    """The rank whose file does not become the cache (another linked its own first) drops its own and
    opens the winner's: one copy per machine, no stray file left."""
    from yolokit.data.store import cache

    monkeypatch.setattr(cache, "SHM", tmp_path)
    ram = RamCache.__new__(RamCache)
    ram.n, ram.nbytes = 3, 8192
    real_link = os.link

    def another_rank_first(src, dst):
        (tmp_path / "winner").write_bytes(b"w" * 8192)
        real_link(tmp_path / "winner", dst)          # the other rank's link lands first
        return real_link(src, dst)                   # so this one raises FileExistsError

    monkeypatch.setattr(cache.os, "link", another_rank_first)
    fd = ram._open(1, 2, "run-token")
    try:
        assert os.read(fd, 4) == b"wwww"              # the winner's file
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["winner", os.path.basename(ram.path)])
    finally:
        os.close(fd)
