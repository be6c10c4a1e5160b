"""Read shards (`yolokit.data.store.shards`) from a folder or object storage, through litdata.

`shard_index(url)` opens one split's label index (`labels.npz`: every image's size, boxes and key
as flat arrays, so a million images cost tens of MB, not a Python object each) and returns a
`SplitIndex` whose `store` is a `ShardStore`. The dataset reads an image's bytes with
`store.read(item)`: litdata downloads the chunk that holds it into a local cache bounded by
``max_cache`` (evicting chunks it no longer needs), and reads the item from there.

Which images a batch holds stays the sampler's business (`ShardedBatchSampler`, `groups`): it
visits the chunks in a seeded order and shuffles within them, so the same steps come out of
1 or N processes, resume is exact, and a process touches a few chunks at a time.

Faults:
- a chunk shorter than the index says, or whose items cannot be read back, is *lost*: named once
  in the log, counted (`lost_images`, shared with the loader's workers), and its images are
  replaced by readable ones as an unreadable file is;
- a store that does not answer: `StoreError` after retries with backoff, naming the chunk.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from yolokit.data.sources.images import ImageError
from yolokit.data.sources.labels import EXCLUDED, Problem, SplitIndex, cache_home
from yolokit.data.sources.segments import Segments
from yolokit.data.store.cap import parse_size, remove_orphans
from yolokit.data.store.remote import Place, allow_plain_http, is_remote, join, quiet_cap_advice, quiet_litdata_threads
from yolokit.data.workers import SharedArray

logger = logging.getLogger("yolokit.data")

MANIFEST, LABELS = "yolokit-shards.json", "labels.npz"


class ShardLost(ImageError):
    """The chunk holding an image cannot be read: its images are replaced, as an unreadable file's is.

    Attributes:
        next_item: the first item after the lost chunk (the dataset tries that one next).
    """

    def __init__(self, message: str, next_item: int = -1) -> None:
        super().__init__(message)
        self.next_item = next_item


def split_cache(url: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The local cache folder of one remote split (its chunks, its label index)."""
    return Path(cache_dir or cache_home() / "shards") / hashlib.sha1(url.encode()).hexdigest()[:16]


class ShardStore:
    """The items of one split's shards, read through litdata with a bounded local cache.

    Picklable: a loader's workers (fork or spawn) each open their own litdata reader; the
    lost-chunk flags are shared with them.

    Args:
        url: the split's folder or ``s3://bucket/prefix/split``.
        index: the split's ``index.json`` as read (litdata's index of the chunks).
        cache_dir: where remote chunks are kept; default ``cache_home()/shards`` (a folder per split).
        max_cache: the cache's cap ("25GB"); chunks beyond it are evicted, least needed first.
    """

    def __init__(self, url: str, index: bytes, *, cache_dir: str | os.PathLike | None = None,
                 max_cache: int | str | None = "25GB") -> None:
        self.url, self.remote, self.index = url, is_remote(url), index
        chunks = json.loads(index)["chunks"]
        self.files = [c["filename"] for c in chunks]
        self.sizes = np.array([c["chunk_size"] for c in chunks], np.int64)
        self.nbytes = [int(c["chunk_bytes"]) for c in chunks]
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.cache_dir = str(split_cache(url, cache_dir)) if self.remote else None   # one folder per split
        self.max_cache = parse_size(max_cache)
        self.lost = SharedArray("b", [0] * max(1, len(chunks)))   # 1: the chunk is lost
        self.keys: Keys | None = None       # each item's key: an item read back with another is from a corrupt chunk
        self._place = Place(url)
        self._reader, self._pid, self._checked, self._mapped, self._folder = None, None, set(), False, None
        self._lock = threading.Lock()      # litdata's reader is not for several threads (the disk cache's fill)
        try:                               # imported here, before a loader forks its workers: 0.25 s in each otherwise
            import litdata  # noqa: F401
        except ImportError as err:
            raise ImportError("shards need the streaming engine: pip install 'yolokit[stream]' (litdata)") from err

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_reader": None, "_pid": None, "_checked": set(), "_lock": None, "_mapped": False}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def chunk_of(self, items: np.ndarray | int) -> np.ndarray | int:
        """The chunk of each item."""
        return np.searchsorted(self.starts, items, side="right") - 1

    def stamp(self, item: int) -> str:
        """What names item ``item``'s content: the split, the item, its chunk's file and size."""
        chunk = int(self.chunk_of(item))
        return f"{self.url}|{item}|{self.files[chunk]}|{self.nbytes[chunk]}"

    def lost_chunks(self) -> list[int]:
        """The chunks found unreadable so far (by this process or its loader's workers)."""
        return np.flatnonzero(np.frombuffer(self.lost.array, np.int8)[:len(self.files)]).tolist()

    @property
    def lost_images(self) -> int:
        """Images of the chunks found unreadable so far (by this process or its workers)."""
        return int(self.sizes[self.lost_chunks()].sum())

    def cache_bytes(self) -> int:
        """Bytes in this split's local cache now (0 for local shards, read in place)."""
        if not self.cache_dir or not os.path.isdir(self.cache_dir):
            return 0
        return sum(f.stat().st_size for f in Path(self.cache_dir).rglob("*.bin") if f.is_file())

    @property
    def total_bytes(self) -> int:
        """The bytes of all the split's chunks."""
        return int(sum(self.nbytes))

    def chunk_folder(self) -> str:
        """The folder of a remote split's chunks, where its litdata reader downloads them: one per version
        of the split (named by its ``index.json``, which is written there first, so that a reader opens
        without asking the store), beside the label index. Made here; an older version's folder is removed."""
        if self._folder is None:
            self._folder = Path(self.cache_dir) / ("chunks-" + hashlib.sha1(self.index).hexdigest()[:16])
            remove_orphans(self._folder)
        folder = self._folder
        if not os.path.isfile(os.path.join(folder, "index.json")):
            folder.mkdir(parents=True, exist_ok=True)
            for old in Path(self.cache_dir).iterdir():       # chunks of an older write of the split
                if old.is_dir() and old != folder:
                    shutil.rmtree(old, ignore_errors=True)
            part = folder / f"index.json.{os.getpid()}.{threading.get_ident()}"
            part.write_bytes(self.index)
            os.replace(part, folder / "index.json")
        return str(folder)

    def cached(self, chunk: int) -> bool:
        """Whether chunk ``chunk`` of a remote split is whole in ``chunk_folder``."""
        try:
            return os.stat(os.path.join(self.chunk_folder(), self.files[chunk])).st_size >= self.nbytes[chunk]
        except FileNotFoundError:
            return False

    def _await_download(self, chunk: int, limit: float = 300.0) -> None:
        """Waits, looking every 20 ms, while another process downloads chunk ``chunk`` (it holds the chunk's
        lock: the prefetch, or another worker). litdata's own read would wait for a signal from its own
        download thread, which never comes for another process's download, and look again only after a
        second (litdata 0.2.76). Returns at once when the chunk is on disk or nobody is downloading it (then
        the reader downloads it); after ``limit`` s the reader's own wait takes over."""
        if self.cached(chunk):
            return
        from filelock import FileLock, Timeout

        lock = FileLock(os.path.join(self.chunk_folder(), self.files[chunk]) + ".lock", timeout=0)
        deadline = time.monotonic() + limit
        while not self.cached(chunk) and time.monotonic() < deadline:
            try:
                with lock:                      # nobody is downloading it
                    return
            except Timeout:
                time.sleep(0.02)

    def fetch_chunk(self, chunk: int) -> Path:
        """Downloads chunk ``chunk`` into ``chunk_folder``: whole, or not at all (a temporary
        file renamed into place), under the lock litdata's own download takes (``<chunk>.lock``), so that a
        worker and this never fetch the same chunk twice; nothing when another holds it. Raises StoreError
        as a read does."""
        from filelock import FileLock, Timeout

        target = Path(self.chunk_folder()) / self.files[chunk]
        try:
            with FileLock(f"{target}.lock", timeout=0):
                if not (target.is_file() and target.stat().st_size >= self.nbytes[chunk]):
                    self._place.fetch(self.files[chunk], target)
        except Timeout:                        # a worker is downloading it
            pass
        return target

    def _open(self):
        if self._reader is None or self._pid != os.getpid():
            from litdata import StreamingDataset
            from litdata.streaming.resolver import Dir

            allow_plain_http()
            quiet_litdata_threads()
            logging.getLogger(StreamingDataset.__module__).addFilter(quiet_cap_advice)
            kwargs = {"max_cache_size": self.max_cache} if self.remote and self.max_cache else {}
            # batch_decode=0: decode the item asked for, not the 256 around it (an image's neighbours in the
            # order are seldom its neighbours in the chunk)
            # a remote split: litdata's reader downloads into chunk_folder(), where it finds index.json (it would
            # otherwise fetch it twice and make two S3 clients, 0.65 s in each process, for a folder of its own)
            where = Dir(path=self.chunk_folder(), url=self.url) if self.remote else self.url
            reader = StreamingDataset(where, batch_decode=0, **kwargs)
            reader._on_demand_bytes = False      # whole chunks into the cache: the sampler reads chunk by chunk
            self._reader, self._pid, self._checked, self._mapped = reader, os.getpid(), set(), False
        return self._reader

    def _map_chunks(self) -> None:
        """Let litdata memory-map the cached chunks (its cache made first, as its ``__getitem__`` makes it).

        litdata maps only the chunks its own iteration hands a worker; an item read by index from any
        other chunk reads the whole chunk file to look for a header (about 45 ms for an image of a
        64 MB chunk, against 0.1 ms mapped). Mapping every chunk is safe here: litdata publishes a
        chunk by renaming a finished download into place and evicts by deleting, and a mapped file
        that is renamed over or deleted stays readable until it is unmapped.
        """
        reader = self._reader
        if getattr(reader, "cache", None) is None and hasattr(reader, "_create_cache"):
            from litdata.utilities.env import _WorkerEnv

            reader.worker_env = _WorkerEnv.detect()
            reader.cache = reader._create_cache(worker_env=reader.worker_env)
            reader.shuffler = reader._create_shuffler(reader.cache)
        enable = getattr(getattr(getattr(reader, "cache", None), "_reader", None), "enable_mmap_for_chunks", None)
        if enable is not None:
            enable(set(range(len(self.files))))
        self._mapped = True

    def _lose(self, chunk: int, why: str) -> ShardLost:
        first = not self.lost.array[chunk]
        self.lost.array[chunk] = 1
        if first:
            logger.warning("shard %s is unreadable (%s): its %d image(s) are skipped",
                           join(self.url, self.files[chunk]), why, int(self.sizes[chunk]))
        return ShardLost(f"in lost shard {self.files[chunk]}", int(self.starts[chunk + 1]) % len(self))

    def read(self, item: int) -> np.ndarray:
        """The encoded bytes of item ``item`` (its number in the split) as uint8 [N].

        Raises:
            ShardLost: its chunk is unreadable (it is skipped from now on).
            StoreError: the store did not answer after retries with backoff.
        """
        with self._lock:
            return self._read(item)

    def _read(self, item: int) -> np.ndarray:
        chunk = int(self.chunk_of(item))
        if self.lost.array[chunk]:
            raise ShardLost(f"in lost shard {self.files[chunk]}", int(self.starts[chunk + 1]) % len(self))
        if chunk not in self._checked:          # a chunk cut short would make litdata wait for the rest
            if not (self.remote and self.cached(chunk)):    # (one already whole on disk is read from there)
                size = self._place.size(self.files[chunk])
                if size != self.nbytes[chunk]:
                    raise self._lose(chunk, "missing" if size is None else f"{size} of {self.nbytes[chunk]} bytes")
            self._checked.add(chunk)
        if self.remote:
            self._await_download(chunk)
        last = None
        for _ in range(2):                     # a failed read: the store down (StoreError, after its retries),
            try:                                # or a glitch (read again), or a corrupt chunk (lost)
                reader = self._open()
                if not self._mapped:
                    self._map_chunks()
                value = reader[int(item)]
                break
            except Exception as err:
                last, self._reader = err, None
                self._place.size(self.files[chunk])
        else:
            raise self._lose(chunk, f"{type(last).__name__}: {str(last)[:200]}")
        if not isinstance(value, dict) or "image" not in value or (
                self.keys is not None and value.get("key") != self.keys.key(item)):
            raise self._lose(chunk, "an item does not match the label index")
        return np.frombuffer(value["image"], np.uint8)


class _Ragged(Sequence):
    """Item i of a flat array cut at ``offsets`` (one Python object per item only when asked for)."""

    def __init__(self, offsets: np.ndarray) -> None:
        self.offsets = offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = int(i) + (len(self) if int(i) < 0 else 0)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._item(i)


class Keys(_Ragged):
    """The items' paths (the split's url and each image's key), made on demand from one byte array."""

    def __init__(self, base: str, blob: np.ndarray, offsets: np.ndarray) -> None:
        super().__init__(offsets)
        self.base, self.blob = base, blob

    def key(self, i: int) -> str:
        return self.blob[self.offsets[i]:self.offsets[i + 1]].tobytes().decode()

    def _item(self, i: int) -> str:
        return f"{self.base}/{self.key(i)}"


class FlatLabels(_Ragged):
    """Each item's float32 [G, 5] labels, as views of one array."""

    def __init__(self, labels: np.ndarray, offsets: np.ndarray) -> None:
        super().__init__(offsets)
        self.labels = labels

    def _item(self, i: int) -> np.ndarray:
        return self.labels[self.offsets[i]:self.offsets[i + 1]]


def is_shards(spec: str | os.PathLike) -> bool:
    """Whether ``spec`` names shards: an ``s3://`` url, or a folder holding a label index or a manifest."""
    if is_remote(spec):
        return True
    p = Path(spec)
    return p.is_dir() and ((p / LABELS).is_file() or (p / MANIFEST).is_file())


def shards_root_split(url: str, split: str) -> str:
    """The split's url: ``url/split`` for the root `yolokit data shard` wrote, or ``url`` itself when it is
    that split's folder (one split's url asked for another split is refused: training would validate on
    its own images)."""
    url = str(url).rstrip("/")
    if Place(url).size(LABELS) is None:
        return join(url, split)
    if url.rsplit("/", 1)[-1] != split:
        raise FileNotFoundError(f"{url} holds the shards of one split ({url.rsplit('/', 1)[-1]}), not of "
                                f"'{split}': name the folder above it, or a data.yaml naming both splits")
    return url


def shard_index(url: str | os.PathLike, *, names: list[str] | None = None, cache_dir: str | os.PathLike | None = None,
                max_cache: int | str | None = "25GB") -> SplitIndex:
    """The `SplitIndex` of one split's shards; its images are read through ``index.store``.

    Args:
        url: the split's folder or ``s3://.../split``.
        names: class names (default: the manifest's beside the split).
        cache_dir, max_cache: the local chunk cache (remote shards).

    Raises:
        FileNotFoundError: no finished shards there (`yolokit data shard` writes the index last).
        StoreError / CredentialsError: the store cannot be reached, or refuses the credentials.
    """
    url = str(url).rstrip("/")
    place = Place(url)
    place.check()
    try:
        index_json = place.read("index.json")
        # from a file, array by array (a million images: 92 MB), not from one more copy of it in memory
        arrays = np.load(place.fetch(LABELS, split_cache(url, cache_dir) / LABELS), allow_pickle=False)
    except FileNotFoundError:
        raise FileNotFoundError(f"{url}: no finished shards (index.json and {LABELS}); write them with "
                                "`yolokit data shard SRC OUT` (run it again to finish a cut-short write)") from None
    manifest: dict = {}
    if names is None:
        try:
            manifest = json.loads(Place(url.rsplit("/", 1)[0]).read(MANIFEST))
        except FileNotFoundError:
            raise FileNotFoundError(f"{url}: no {MANIFEST} beside the split to name the classes") from None
        names = list(manifest["names"])
    store = ShardStore(url, index_json, cache_dir=cache_dir, max_cache=max_cache)
    n = len(arrays["shapes"])
    if n != len(store):
        raise FileNotFoundError(f"{url}: {LABELS} lists {n} images, index.json {len(store)}: "
                                "the write did not finish; run `yolokit data shard` again")
    split = url.rsplit("/", 1)[-1]
    problems = [Problem(*p) for p in manifest.get("splits", {}).get(split, {}).get("problems", [])]
    image_ids = arrays["image_ids"].tolist() if len(arrays["image_ids"]) == n else None
    store.keys = Keys(url, arrays["keys"], arrays["key_offsets"])
    index = SplitIndex(paths=store.keys, shapes=arrays["shapes"],
                       labels=FlatLabels(arrays["labels"], arrays["label_offsets"]), names=names,
                       problems=[p for p in problems if p.action == EXCLUDED], image_ids=image_ids,
                       category_ids=manifest.get("category_ids"), store=store, items=np.arange(n, dtype=np.int64),
                       segments=Segments.from_arrays(arrays))     # None: a detection set, or shards from before
    return index
