"""Decoded, resized images kept for training: in RAM once per machine, or as files on disk.

``cache="ram"`` (:class:`RamCache`): every image decoded and resized once into one block of
shared memory (a file in ``/dev/shm``), which every process of the machine maps: the local
ranks of a multi-process run and their loader workers (forked or spawned) read the same
pages, so the machine holds one copy, not one per process. The ranks fill it together, each
its share of the images with a thread pool, and local rank 0 shows a progress bar. Before
anything is filled the memory it needs is checked against what the machine has: a cache
that would not fit is refused with both figures, naming ``cache="disk"``. The file is
unlinked as soon as every local rank has mapped it, so nothing is left in ``/dev/shm`` when
the processes end, however they end.

``cache="disk"`` (:class:`DiskCache`): each decoded, resized image is a ``.npy`` file under
``<cache_home>/images`` (``$YOLOKIT_CACHE``), named from the image's path, size, mtime and
the training size, so a changed image or another ``imgsz`` is a miss, never a stale hit.
Files are written atomically (a temporary file renamed into place), so a fill that was
killed leaves nothing half-written that a later run would read. Runs reuse the files.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import reduction
from multiprocessing.context import get_spawning_popen
from pathlib import Path

import cv2
import numpy as np
from tqdm import tqdm

Reader = Callable[[int], np.ndarray]            # index -> BGR image resized to the long side imgsz
_MAGIC, _FILLED, _FAILED = b"YKCACHE1", 1, 2      # per-image flags: 0 not yet, filled, unreadable
SHM = Path("/dev/shm")


def resized_shape(h: int, w: int, imgsz: int) -> tuple[int, int]:
    """``(h, w)`` of an image of ``(h, w)`` resized so that its long side is ``imgsz``."""
    r = imgsz / max(h, w)
    return (h, w) if r == 1 else (max(1, round(h * r)), max(1, round(w * r)))


def memory_available() -> int:
    """Bytes of RAM the machine can still give (``MemAvailable``), without swapping."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


class RamCache:
    """One copy of the resized images per machine, in shared memory (see the module docstring).

    Args:
        shapes: int [n, 2] original ``(h, w)`` of each image.
        imgsz: the long side images are resized to.
        read: decodes and resizes image ``i``; may raise (the image is then read again at run time).
        peers: ``(local_rank, local_world, token)`` of the processes on this machine that share
            the cache; ``token`` names this run (equal on its processes, different from other
            runs'). None: this process alone (and its loader workers).
        timeout: seconds to wait for the other local ranks (to map the cache, to fill their share).
        threads: decoding threads of this process.
        progress: show a progress bar (local rank 0).
        available: bytes of RAM available; default: measured (a test can pass a figure).
    """

    def __init__(self, shapes: np.ndarray, imgsz: int, read: Reader, *, peers: tuple[int, int, str] | None = None,
                 timeout: float = 1800.0, threads: int | None = None, progress: bool = True,
                 available: int | None = None) -> None:
        self.n = len(shapes)
        sizes = [resized_shape(int(h), int(w), imgsz) for h, w in shapes]
        self.shapes = np.array(sizes, dtype=np.int64).reshape(-1, 2)
        self.offsets = np.concatenate([[0], np.cumsum(self.shapes[:, 0] * self.shapes[:, 1] * 3)])
        local_rank, local_world, token = peers or (0, 1, "")
        head = 64 + local_world + self.n                   # magic, n, world; attach slots; per-image flags
        self.data_start = (head + 4095) // 4096 * 4096
        self.nbytes = int(self.data_start + self.offsets[-1])
        self._check_fits(int(self.offsets[-1]), imgsz, available)
        self.fd = self._open(local_rank, local_world, token)
        self._map()
        self.attached[local_rank] = 1
        if local_world > 1:
            self._wait(lambda: bool(self.attached.all()), timeout, "map the image cache")
            if local_rank == 0:                          # everyone has it mapped: nothing to leave behind
                Path(self.path).unlink(missing_ok=True)
        mine = [i for i in range(self.n) if i % local_world == local_rank]
        self._fill(mine, read, threads or max(1, min(8, (os.cpu_count() or 1) // local_world)),
                   progress and local_rank == 0, timeout)

    # --- storage ------------------------------------------------------------------------------

    def _check_fits(self, need: int, imgsz: int, available: int | None) -> None:
        ram = memory_available() if available is None else available
        shm = os.statvfs(SHM) if SHM.is_dir() else None
        free = shm.f_bavail * shm.f_frsize if shm is not None else ram
        if need > ram or need > free:
            where = (f"{_gb(ram)} of RAM are available" if need > ram else
                     f"{SHM} has {_gb(free)} free (in a container: docker run --shm-size)")
            raise MemoryError(f'cache="ram" needs {_gb(need)} for {self.n:,} images at imgsz {imgsz}, but {where}; '
                              'use cache="disk" (decoded images as files, read back at disk speed) or no cache')

    def _open(self, local_rank: int, local_world: int, token: str) -> int:
        """The cache file: this run's in ``/dev/shm`` (created by the first rank to get there), or,
        alone, an unnamed one (unlinked at once)."""
        if local_world == 1:
            fd, path = tempfile.mkstemp(prefix="yolokit-cache-", dir=SHM if SHM.is_dir() else None)
            os.unlink(path)
            os.ftruncate(fd, self.nbytes)
            self.path = path
            return fd
        key = hashlib.sha1(f"{token}|{self.n}|{self.nbytes}".encode()).hexdigest()[:16]
        self.path = str(SHM / f"yolokit-cache-{key}")
        try:
            return os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            pass
        fd, tmp = tempfile.mkstemp(prefix=".yolokit-cache-", dir=SHM)
        os.ftruncate(fd, self.nbytes)
        with mmap.mmap(fd, 64) as head:
            head[:24] = _MAGIC + self.n.to_bytes(8, "little") + local_world.to_bytes(8, "little")
        try:
            os.link(tmp, self.path)                     # atomic: only one rank's file becomes the cache
        except FileExistsError:
            os.close(fd)
            os.unlink(tmp)
            return os.open(self.path, os.O_RDWR)
        os.unlink(tmp)
        return fd

    def _map(self) -> None:
        self.map = mmap.mmap(self.fd, self.nbytes)
        buffer = np.frombuffer(self.map, dtype=np.uint8)
        head = buffer[:64].tobytes()
        if head[:8] != _MAGIC and head[:8] != b"\0" * 8:
            raise RuntimeError(f"{self.path} is not a yolokit image cache")
        world = int.from_bytes(head[16:24], "little") or 1
        self.attached = buffer[64:64 + world]
        self.flags = buffer[64 + world:64 + world + self.n]
        self.data = buffer[self.data_start:]

    def __getstate__(self) -> dict:
        """Spawned loader workers get the file descriptor (they map the same pages); any other
        pickling (a copy of the dataset) gets the images themselves."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("map", "attached", "flags", "data", "fd")}
        if get_spawning_popen() is not None:
            return {**state, "fd": reduction.DupFd(self.fd)}
        return {**state, "copy": self.data.copy(), "flags_copy": self.flags.copy()}

    def __setstate__(self, state: dict) -> None:
        copy, flags = state.pop("copy", None), state.pop("flags_copy", None)
        self.__dict__.update(state)
        if copy is None:
            self.fd = state["fd"].detach()
            self._map()
        else:
            self.fd, self.map, self.data, self.flags, self.attached = -1, None, copy, flags, np.ones(1, np.uint8)

    # --- filling and reading ---------------------------------------------------------------------

    def _store(self, i: int, read: Reader) -> None:
        try:
            image = read(i)
        except Exception:
            self.flags[i] = _FAILED                     # read again, and reported, when it is used
            return
        h, w = self.shapes[i]
        if image.shape[:2] != (h, w):                   # decoded other than indexed: fit the slot
            image = cv2.resize(image, (int(w), int(h)), interpolation=cv2.INTER_LINEAR)
        self.data[self.offsets[i]:self.offsets[i + 1]] = image.reshape(-1)
        self.flags[i] = _FILLED

    def _fill(self, mine: list[int], read: Reader, threads: int, progress: bool, timeout: float) -> None:
        bar = tqdm(total=self.n, desc=f"caching {self.n:,} images in RAM ({_gb(self.offsets[-1])})",
                   disable=not progress, unit="img", leave=False)
        pool = ThreadPoolExecutor(threads)
        try:
            pending = [pool.submit(self._store, i, read) for i in mine]
            while not all(f.done() for f in pending):
                time.sleep(0.1)
                bar.update(int(np.count_nonzero(self.flags)) - bar.n)
            for f in pending:
                f.result()
        finally:                                        # Ctrl-C: the images not started are not read
            pool.shutdown(wait=True, cancel_futures=True)

        def all_filled() -> bool:                      # the other ranks' shares too
            bar.update(int(np.count_nonzero(self.flags)) - bar.n)
            return bool(self.flags.all())

        self._wait(all_filled, timeout, "fill their share of the image cache")
        bar.close()

    def _wait(self, done: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the other processes of this machine did not {what} in {timeout:.0f} s "
                                   f"({self.path})")
            time.sleep(0.05)

    def get(self, i: int) -> np.ndarray | None:
        """Image ``i`` (a read-only view of the shared pages), or None when it could not be read."""
        if self.flags[i] != _FILLED:
            return None
        h, w = self.shapes[i]
        view = self.data[self.offsets[i]:self.offsets[i + 1]].reshape(int(h), int(w), 3)
        view.flags.writeable = False
        return view


class DiskCache:
    """Decoded, resized images as ``.npy`` files, reused across runs (see the module docstring).

    Args:
        paths: the image files.
        imgsz: the long side images are resized to.
        root: the cache folder (default ``cache_home() / "images"``, passed by the dataset).
    """

    def __init__(self, paths: Sequence[str], imgsz: int, root: str | os.PathLike,
                 stamp: Callable[[int], str] | None = None):
        self.paths, self.imgsz, self.root, self.stamp = list(paths), imgsz, Path(root), stamp

    def file(self, i: int) -> Path:
        """The cache file of image ``i``: named by its path, size, mtime and the training size (images
        from shards: by ``stamp(i)``, which changes when the shard does)."""
        if self.stamp is not None:
            key = hashlib.sha1(f"{self.stamp(i)}|{self.imgsz}".encode()).hexdigest()
            return self.root / key[:2] / f"{key[2:]}.npy"
        path = os.path.abspath(self.paths[i])
        st = os.stat(path)
        key = hashlib.sha1(f"{path}|{st.st_size}|{st.st_mtime_ns}|{self.imgsz}".encode()).hexdigest()
        return self.root / key[:2] / f"{key[2:]}.npy"

    def get(self, i: int, read: Reader) -> np.ndarray:
        """Image ``i`` from its file, or decoded by ``read`` and written for the next time."""
        try:
            target = self.file(i)
        except OSError:
            return read(i)                              # gone from disk: read() reports it
        try:
            image = np.load(target, allow_pickle=False)
            if image.ndim == 3 and image.dtype == np.uint8:
                return image
        except (OSError, ValueError, EOFError):
            pass                                        # a miss (or a foreign file): decode again
        image = read(i)
        self._write(target, image)
        return image

    def fill(self, indices: Sequence[int], read: Reader, *, threads: int = 4, progress: bool = True) -> int:
        """Writes the missing files of ``indices`` in parallel; returns how many were written."""
        missing = [i for i in indices if not self._cached(i)]
        bar = tqdm(total=len(missing), desc=f"caching {len(missing):,} images on disk ({self.root})",
                   disable=not progress or not missing, unit="img", leave=False)

        def one(i: int) -> None:
            with contextlib.suppress(Exception):        # unreadable: read again, and reported, when used
                self._write(self.file(i), read(i))
            bar.update(1)

        pool = ThreadPoolExecutor(max(1, threads))
        try:
            list(pool.map(one, missing))
        finally:                                        # Ctrl-C: the images not started are not read
            pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
        return len(missing)

    def _cached(self, i: int) -> bool:
        try:
            return self.file(i).is_file()
        except OSError:                                 # the image is gone: read() will say so
            return False

    @staticmethod
    def _write(target: Path, image: np.ndarray) -> None:
        """Atomically: a temporary file renamed into place. A full or read-only disk: not cached."""
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}.", suffix=".tmp", dir=target.parent)
        except OSError:
            return
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, np.ascontiguousarray(image), allow_pickle=False)
            os.replace(tmp, target)
        except OSError:
            Path(tmp).unlink(missing_ok=True)

