"""Chunks fetched ahead of the loader's workers (`data.store.prefetch`), from the store at a distance
(tests/latency_proxy.py): the same batches as without, each chunk downloaded once, in the sampler's order,
within the cache cap, and no thread left behind."""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from yolokit.data import DetectionDataset, build_dataloader, make_shapes

pytestmark = pytest.mark.skipif(importlib.util.find_spec("litdata") is None, reason="needs yolokit[stream]")


@pytest.fixture(scope="module")
def url(s3_store, tmp_path_factory):
    from yolokit.data.store.shards import write_shards

    url = s3_store.bucket("prefetch") + "/set"
    with pytest.MonkeyPatch.context() as mp:
        for k, v in s3_store.env.items():
            mp.setenv(k, v)
        write_shards(make_shapes(tmp_path_factory.mktemp("set") / "set", seed=6, n_train=48, n_val=4, imgsz=96),
                     url, chunk_bytes="12KB", splits=["train"])
    return url


def _threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "yolokit-chunk-prefetch"]


def _epoch(url, tmp_path, name, monkeypatch, *, ahead, cap="25GB", yielded=None, counted=None):
    monkeypatch.setenv("YOLOKIT_CACHE", str(tmp_path / name))
    dataset = DetectionDataset(f"{url}/train", "train", imgsz=96, augment=True, shards={"max_cache": cap})
    if counted is not None:                                 # the relay counts the epoch's requests only
        counted.reset()
    loader = build_dataloader(dataset, 4, workers=2, seed=1, uint8_images=True, chunks_ahead=ahead)
    batches = []
    for b in loader:
        if yielded is not None:                             # when each batch came out of the loader
            yielded.append(time.monotonic())
        batches.append((b["indices"], b["images_uint8"].clone()))
    loader.close()
    return dataset.index.store, batches


def test_prefetch_gives_the_same_batches_with_each_chunk_downloaded_once_in_order(url, distant_env, tmp_path,
                                                                                   monkeypatch):
    from yolokit.data.store.stream import ShardStore

    fetched, done, real = [], {}, ShardStore.fetch_chunk

    def fetch(self, chunk):                                 # which chunks the prefetch downloaded itself, and when
        target = Path(self.chunk_folder()) / self.files[chunk]
        had = target.exists()
        real(self, chunk)
        fetched.append(chunk)
        if not had and target.exists():
            done[chunk] = time.monotonic()

    monkeypatch.setattr(ShardStore, "fetch_chunk", fetch)
    yielded = []
    store, with_prefetch = _epoch(url, tmp_path, "ahead", monkeypatch, ahead=2, yielded=yielded, counted=distant_env)
    chunks = len(store.files)
    assert chunks >= 8
    asked = {(method, path.split("?")[0].rsplit("/", 1)[-1]): n for (method, path), n in distant_env.requests.items()}
    assert {name: n for (method, name), n in asked.items() if method == "GET"} == dict.fromkeys(store.files, 1)
    assert {name for _, name in asked} == set(store.files)          # once each, by anyone; no index.json: the
                                                                    # workers' readers open from the cache folder
    assert len(done) >= chunks // 2                                                 # most of them ahead,
    position = _plan_order(with_prefetch, store)
    assert fetched == sorted(fetched, key=position)                                 # in the batches' order,
    first_yield = {}
    for (indices, _), when in zip(with_prefetch, yielded, strict=True):
        for chunk in store.chunk_of(torch.as_tensor(indices).numpy()).tolist():
            first_yield.setdefault(chunk, when)
    assert all(done[c] < first_yield[c] for c in done), (done, first_yield)        # each there before its batch
    assert not _threads()
    _, plain = _epoch(url, tmp_path, "plain", monkeypatch, ahead=0)
    assert [i for i, _ in with_prefetch] == [i for i, _ in plain]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(with_prefetch, plain, strict=True))


def _plan_order(batches, store):
    """The position of each chunk in the order the epoch's batches first touch them."""
    order = {}
    for indices, _ in batches:
        for chunk in store.chunk_of(torch.as_tensor(indices).numpy()).tolist():
            order.setdefault(chunk, len(order))
    return order.__getitem__


def test_prefetch_stays_within_the_cap_and_leaves_no_thread(url, distant_env, tmp_path, monkeypatch):
    from yolokit.data.store.stream import ShardStore

    seen, real = [], ShardStore.fetch_chunk

    def fetch(self, chunk):                               # what the cache holds when a fetch starts
        seen.append(self.cache_bytes() + self.nbytes[chunk] <= self.max_cache)
        return real(self, chunk)

    monkeypatch.setattr(ShardStore, "fetch_chunk", fetch)
    monkeypatch.setenv("YOLOKIT_CACHE", str(tmp_path / "capped"))
    dataset = DetectionDataset(f"{url}/train", "train", imgsz=96, augment=True, shards={"max_cache": "100KB"})
    loader = build_dataloader(dataset, 4, workers=2, seed=1, uint8_images=True, chunks_ahead=3)
    store, held, running = dataset.index.store, [], threading.Event()

    def sample():                                           # the cache's bytes, every 5 ms through the epoch
        while not running.is_set():
            held.append(store.cache_bytes())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        assert sum(len(b["indices"]) for b in loader) == 48 and seen and all(seen)
    finally:
        running.set()
        sampler.join()
    assert store.total_bytes > store.max_cache                       # the split does not fit: evictions
    assert len(held) > 20 and max(held) <= store.max_cache, (max(held), store.max_cache)
    batches = iter(loader)                                  # an epoch dropped after one batch
    next(batches)
    assert _threads()
    del batches
    _gone(_threads)
    loader.close()


def _gone(what, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while what() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not what(), what()


def test_a_loader_deleted_mid_epoch_leaves_no_thread_and_no_worker(url, distant_env, tmp_path, monkeypatch):
    import gc
    import multiprocessing

    monkeypatch.setenv("YOLOKIT_CACHE", str(tmp_path / "deleted"))
    dataset = DetectionDataset(f"{url}/train", "train", imgsz=96, augment=True)
    before = set(multiprocessing.active_children())
    loader = build_dataloader(dataset, 4, workers=2, seed=1, uint8_images=True, persistent_workers=True)
    batches = iter(loader)
    next(batches)
    assert _threads() and len(set(multiprocessing.active_children()) - before) == 2
    del batches, loader                                     # mid-epoch: the loader itself dropped
    gc.collect()
    _gone(_threads)
    _gone(lambda: set(multiprocessing.active_children()) - before)


def test_the_plan_follows_the_chunks_of_a_fraction_of_the_split(url, distant_env, tmp_path, monkeypatch):
    """With ``fraction`` the dataset's index i is the store's item ``index.items[i]``: the plan's chunks are
    those the batches' images are in."""
    from yolokit.data.samplers import ShardedBatchSampler
    from yolokit.data.store.prefetch import prefetching

    monkeypatch.setenv("YOLOKIT_CACHE", str(tmp_path / "fraction"))
    dataset = DetectionDataset(f"{url}/train", "train", imgsz=96, fraction=0.5)
    assert len(dataset) == 24 and dataset.index.items.max() > 24          # a sample of the split, not its start
    sampler = ShardedBatchSampler(len(dataset), 4, seed=2, groups=dataset.index.groups)
    prefetch = prefetching(dataset, sampler, 2)
    try:
        expected = list(dict.fromkeys(int(dataset.index.groups[i]) for batch in sampler for i in batch))
        assert prefetch.order == expected
    finally:
        prefetch.close()


def test_a_split_written_again_is_read_anew_from_a_folder_of_its_own(s3_env, tmp_path, monkeypatch):
    """The chunk folder is named by the split's index.json: a split written again at the same address (other
    images, chunks of the same names) is read from a new folder, and the old one is removed."""
    from yolokit.data.store.remote import Place
    from yolokit.data.store.shards import write_shards

    url = s3_env.bucket("prefetch") + "/again"
    monkeypatch.setenv("YOLOKIT_CACHE", str(tmp_path / "cache"))
    read = []
    for seed in (1, 2):
        place = Place(url)
        for name in place.names():                          # written again from another source: emptied first
            place.remove(name)
        data = make_shapes(tmp_path / f"set{seed}", seed=seed, n_train=6, n_val=2, imgsz=64)
        write_shards(data, url, chunk_bytes="8KB", splits=["train"], log_every=0)
        store = DetectionDataset(f"{url}/train", "train", imgsz=64).index.store
        folder = Path(store.chunk_folder())
        read.append((folder, [store.read(i).tobytes() for i in range(len(store))]))
        assert (folder / "index.json").read_bytes() == store.index
        assert sorted(p.name for p in folder.parent.iterdir() if p.is_dir()) == [folder.name]   # the old one gone
    (first, old), (second, new) = read
    assert first != second and old != new
    expected = [p.read_bytes() for p in sorted((tmp_path / "set2" / "images" / "train").iterdir())]
    assert sorted(new) == sorted(expected)                  # the second write's images, not cached ones


def test_a_chunk_whole_on_disk_is_read_without_asking_the_store(url, distant_env, tmp_path, monkeypatch):
    """A chunk the prefetch put on disk is read from there: not even its size is asked (a chunk not there is
    checked for its size, then downloaded: a chunk cut short in the store would make litdata wait forever)."""
    monkeypatch.setenv("YOLOKIT_CACHE", str(tmp_path / "whole"))
    store = DetectionDataset(f"{url}/train", "train", imgsz=96).index.store
    store.fetch_chunk(0)
    distant_env.reset()
    assert store.read(0).size and store.read(int(store.starts[1]) - 1).size
    assert not distant_env.requests                         # the reader opened and read without a request
    store.read(int(store.starts[1]))
    asked = sorted((m, p.split("?")[0].rsplit("/", 1)[-1]) for (m, p) in distant_env.requests)
    assert asked == [("GET", store.files[1]), ("HEAD", store.files[1])]


def test_a_read_waits_for_the_download_another_downloader_holds(url, s3_env, tmp_path, monkeypatch):
    """A chunk whose lock another downloader holds (the prefetch, another worker) is waited for here, looking
    every 20 ms: litdata is asked for the item only once the chunk is whole on disk (its own wait, for a
    signal that never comes from another process, looks again only after a second)."""
    from filelock import FileLock
    from litdata import StreamingDataset

    from yolokit.data.store.remote import Place

    monkeypatch.setenv("YOLOKIT_CACHE", str(tmp_path / "held"))
    store = DetectionDataset(f"{url}/train", "train", imgsz=96).index.store
    target = Path(store.chunk_folder()) / store.files[2]
    asked, real = [], StreamingDataset.__getitem__

    def getitem(self, i):                                   # whether the chunk was there when litdata was asked
        asked.append(store.cached(2))
        return real(self, i)

    monkeypatch.setattr(StreamingDataset, "__getitem__", getitem)
    held = threading.Event()

    def other():                                            # a download of its own, under the chunk's lock
        with FileLock(f"{target}.lock"):
            held.set()
            time.sleep(0.3)
            Place(f"{url}/train").fetch(store.files[2], target)

    downloader = threading.Thread(target=other)
    downloader.start()
    held.wait(10)
    try:
        assert store.read(int(store.starts[2])).size and store.read(int(store.starts[3]) - 1).size
    finally:
        downloader.join()
    assert asked == [True, True]


def test_a_download_cut_short_by_its_process_s_end_is_removed(url, s3_env, tmp_path, monkeypatch):
    """A prefetch thread stopped by the interpreter's exit leaves its partial file (``.<chunk>.<pid>``), a worker
    killed mid-download litdata's (``<chunk>.tmp.<pid>``); no cap counts them: the next process to open the split
    removes those of processes no longer running, once unwritten for 10 minutes."""
    import subprocess
    import sys

    monkeypatch.setenv("YOLOKIT_CACHE", str(tmp_path / "orphans"))
    store = DetectionDataset(f"{url}/train", "train", imgsz=96).index.store
    folder = Path(store.chunk_folder())
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    dead = [folder / f".{store.files[0]}.{ended.pid}", folder / f"{store.files[2]}.tmp.{ended.pid}"]  # ours, litdata's
    alive = folder / f".{store.files[1]}.{os.getppid()}"   # a download still running (the parent is alive)
    recent = folder / f".{store.files[3]}.{ended.pid}"       # written a minute ago: maybe another machine's
    for part in [*dead, alive, recent]:
        part.write_bytes(b"x" * 100)
    for part in [*dead, alive]:                             # unwritten for an hour
        os.utime(part, (time.time() - 3600, time.time() - 3600))
    os.utime(recent, (time.time() - 60, time.time() - 60))
    again = DetectionDataset(f"{url}/train", "train", imgsz=96).index.store
    assert again.chunk_folder() == str(folder)
    assert not any(part.exists() for part in dead) and alive.exists() and recent.exists()
