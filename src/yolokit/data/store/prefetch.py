"""Chunks of a remote split fetched ahead of the loader's workers, in the order the sampler gives.

A worker that needs a chunk nobody has downloaded waits for the whole download; and with several
workers, one that needs a chunk another worker is downloading waits on litdata's in-process signal
that never comes, up to a second, before it looks on disk again (litdata 0.2.76). `ChunkPrefetch`
runs in the training process, one thread per split: at the start of an epoch it is given the
epoch's batches (this rank's, in the order the loader yields them), and as the loader yields them it
keeps the chunks of the next batches on disk before any worker asks, in the folder litdata's readers use
(``ShardStore.chunk_folder``), each written whole under a temporary name and renamed into place (the
way litdata publishes a download, so a worker sees no partial file).

It stays within the cache's cap (a chunk that would pass it waits until it fits) and never fetches
more than ``ahead`` chunks beyond the one in use. A download that fails (a stopped store) is left to
the worker that needs the chunk: its read retries and then fails in one line, as without prefetch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

logger = logging.getLogger("yolokit.data")


class ChunkPrefetch:
    """One split's chunks fetched ahead of ``batches`` (see the module).

    Args:
        store: the split's remote ``ShardStore``.
        batches: the epoch's batches of store items (a dataset index through ``SplitIndex.items``), in the
            order the loader yields them.
        ahead: chunks fetched beyond the one of the batch the loader yields next.
        in_flight: batches the workers hold beyond the one yielded (``workers * prefetch_factor``): a chunk
            first needed by one of them is theirs to fetch (fetched later, it might be read and evicted
            already, and then take room for nothing).
    """

    def __init__(self, store: Any, batches: Sequence[Sequence[int]], *, ahead: int = 2, in_flight: int = 0) -> None:
        self.store, self.ahead, self.in_flight = store, ahead, in_flight
        items = np.concatenate([np.asarray(b, np.int64) for b in batches]) if len(batches) else np.zeros(0, int)
        of_batch = np.repeat(np.arange(len(batches)), [len(b) for b in batches])
        first = np.sort(np.unique(store.chunk_of(items), return_index=True)[1])   # each chunk's first item
        self.order = store.chunk_of(items[first]).tolist()      # the chunks in the order batches first touch them
        self.first_batch = of_batch[first].tolist()             # per chunk of `order`: the first batch needing it
        self.first_use = np.searchsorted(self.first_batch, np.arange(len(batches)), side="right").tolist()
        self.position, self.fetched = 0, 0                      # first_use: per batch, the chunks needed by then
        self.headroom = (ahead + 2) * max(store.nbytes, default=0)
        if self.order and not self.store.cached(self.order[0]) and self._fits(self.order[0]):
            self._fetch(self.order[0])          # the first chunk before any worker asks (they would all wait)
        self._cond, self._stop = threading.Condition(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="yolokit-chunk-prefetch")

    def start(self) -> None:
        """Start fetching ahead: after the loader's workers have started (no fork while it downloads)."""
        self._thread.start()

    def advance(self) -> None:
        """The loader yielded one more batch."""
        with self._cond:
            self.position += 1
            self._cond.notify()

    def close(self, wait: bool = True) -> None:
        """Stop fetching; ``wait``: for a download in flight to finish (not on an error or a stop, whose
        one line should not wait for a store that may not answer). Safe to call twice."""
        self._stop.set()
        with self._cond:
            self._cond.notify()
        if wait and self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=60)

    def _fits(self, chunk: int) -> bool:
        """Whether fetching ``chunk`` keeps the cache ``headroom`` below its cap: room for the chunks the
        workers download themselves, so that litdata never evicts while chunks are fetched ahead (a chunk
        it evicts before its worker reads it costs that worker a 30 s wait in litdata 0.2.76)."""
        cap = self.store.max_cache
        return not cap or self.store.cache_bytes() + self.store.nbytes[chunk] + self.headroom <= cap

    def _run(self) -> None:
        done = 0                                          # chunks of `order` fetched or found present
        while not self._stop.is_set() and done < len(self.order):
            with self._cond:
                at = self.position                        # yielded; the workers hold `in_flight` more
                in_use = self.first_use[min(at + self.in_flight, len(self.first_use) - 1)] if self.first_use else 0
                if done >= in_use + self.ahead:           # far enough ahead: wait for the loader
                    self._cond.wait(timeout=1.0)
                    continue
            chunk = self.order[done]
            if self.store.cached(chunk) or self.first_batch[done] < at + self.in_flight:   # there, or the workers'
                done += 1
                continue
            if not self._fits(chunk):                     # the cap: wait until the workers' evictions free room
                if self._stop.wait(0.2):
                    return
                continue
            self._fetch(chunk)
            done += 1

    def _fetch(self, chunk: int) -> None:
        try:
            self.store.fetch_chunk(chunk)
            self.fetched += 1
        except Exception as exc:                          # the worker's own read reports it, in one line
            logger.debug("prefetch of %s failed: %s: %s", self.store.files[chunk], type(exc).__name__, exc)


class Prefetching:
    """A loader iterator that tells its `ChunkPrefetch` of each batch it yields, and closes it when the
    epoch ends, fails or is dropped."""

    def __init__(self, batches: Iterator, prefetch: ChunkPrefetch) -> None:
        self._batches, self._prefetch = batches, prefetch
        prefetch.start()

    def __iter__(self) -> Prefetching:
        return self

    def __len__(self) -> int:
        return len(self._batches)

    def __next__(self):
        try:
            batch = next(self._batches)
        except StopIteration:
            self._prefetch.close()
            raise
        except BaseException:
            self._prefetch.close(wait=False)
            raise
        self._prefetch.advance()
        return batch

    def __del__(self) -> None:
        self._prefetch.close(wait=False)


def prefetching(dataset: Any, batch_sampler: Any, ahead: int, in_flight: int = 0) -> ChunkPrefetch | None:
    """A `ChunkPrefetch` of the dataset's split following the sampler's batches when it is in a store; None for
    local data, ``ahead`` 0, or a cap too small to leave the workers their room. Its first chunk is on disk
    when this returns."""
    index = getattr(dataset, "index", None)
    store = getattr(index, "store", None)
    if not ahead or store is None or not store.remote or not len(store.files):
        return None
    if store.max_cache and store.max_cache < (ahead + 3) * max(store.nbytes):
        return None
    items = np.asarray(index.items)                       # a dataset index -> its store item (fraction < 1)
    plan = [items[np.asarray(batch, np.int64)] for batch in batch_sampler]
    return ChunkPrefetch(store, plan, ahead=ahead, in_flight=in_flight)
