"""The local cache of remote shards against its cap: sizes ("25GB"), each split's share, and its use.

``parse_size`` reads a size; ``share_cache`` gives the remote splits of a run their shares of one cap
(by bytes); ``CacheUse`` is what the progress line shows of it ("1.2G/25.0G"); ``remove_orphans``
clears a cache folder of downloads that ended with their process.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol


class CachedStore(Protocol):
    """What the cap needs of a split's store (``data.store.stream.ShardStore`` is one)."""

    remote: bool
    total_bytes: int
    max_cache: int | None
    cache_dir: Path | None

    def cache_bytes(self) -> int: ...


def share_cache(stores: Sequence[CachedStore], cap: int | str | None) -> None:
    """One cap for the remote splits of a run: each gets its share in proportion to its bytes."""
    remote = [s for s in stores if s.remote]
    total, cap = sum(s.total_bytes for s in remote), parse_size(cap)
    for s in remote:
        s.max_cache = max(1 << 20, cap * s.total_bytes // max(1, total)) if cap else None


def parse_size(size: int | str | None) -> int | None:
    """Bytes of "20GB", "512MB", "64KB", or an int; None stays None."""
    if size is None or isinstance(size, int):
        return size
    text = str(size).strip().upper().removesuffix("B").removesuffix("I")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    scale = units.get(text[-1:], 1)
    try:
        return int(float(text[:-1] if text[-1:] in units else text) * scale)
    except ValueError:
        raise ValueError(f"cache size: expected a size such as '20GB' or '512MB', got {size!r}") from None


def _gigabytes(n: int) -> str:
    return f"{n / 2**30:.1f}G" if n >= 2**28 else f"{n / 2**20:.1f}M"


class CacheUse:
    """What the local cache of remote shards holds against its cap, for the progress line ("1.2G/25.0G").

    Args:
        stores: the `ShardStore`s of a run's splits (local shards have no cache and are left out).
        every: seconds between two looks at the cache folder (the answer in between is the last one).
    """

    def __init__(self, stores: Sequence[CachedStore], every: float = 2.0) -> None:
        self.stores = [s for s in stores if s.cache_dir]
        self.every, self.seen, self.text = every, -float("inf"), ""

    def __bool__(self) -> bool:
        return bool(self.stores)

    def __call__(self) -> str:
        if time.monotonic() - self.seen >= self.every:
            used = sum(s.cache_bytes() for s in self.stores)
            cap = sum(s.max_cache or 0 for s in self.stores)
            self.text, self.seen = f"{_gigabytes(used)}/{_gigabytes(cap)}", time.monotonic()
        return self.text


def remove_orphans(folder: Path, idle: float = 600.0) -> None:
    """Removes the partial downloads of processes that ended during one, which no cap counts: ours
    (``.<chunk>.<pid>``: a prefetch thread stopped by the interpreter's exit) and litdata's
    (``<chunk>.tmp.<pid>``: a worker killed mid-download). Only those unwritten for ``idle`` seconds: a
    cache shared by several machines holds other machines' downloads, whose pids mean nothing here."""
    parts = [*folder.glob(".*.*"), *folder.glob("*.tmp.*")] if folder.is_dir() else []
    for part in parts:
        pid = part.suffix[1:]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            if time.time() - part.stat().st_mtime < idle:
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            part.unlink(missing_ok=True)
        except OSError:                         # gone meanwhile, or alive and another user's
            pass
