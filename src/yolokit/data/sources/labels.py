"""The index of one split: usable images, their labels, and every problem found.

Labels are kept as float32 rows `(class, x1, y1, x2, y2)` in absolute pixels of
the upright original image. A split index is built once, checked file by file,
and stored in a label cache (a `.npz` read with `allow_pickle=False`, so loading
it never runs code) keyed by a hash of the file names, sizes and mtimes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from yolokit.data.sources.images import read_bytes
from yolokit.data.sources.segments import Segments

logger = logging.getLogger("yolokit.data")

CACHE_VERSION = 2   # 2: polygons of segmentation rows kept (a cache of 1 is rebuilt: it has none)
CACHE_SUFFIX = ".yolokit.cache"

EXCLUDED, FIXED, BACKGROUND = "excluded", "fixed", "background"
_TOL = 1e-5


@dataclass(frozen=True)
class Problem:
    """One file that needed attention.

    Attributes:
        path: the image (or label) file concerned.
        reason: what was wrong and what was done, in words.
        action: "excluded" (image not used), "fixed" (rows dropped or clipped, image
            kept) or "background" (no labels: image kept as a background image).
    """

    path: str
    reason: str
    action: str


@dataclass
class SplitIndex:
    """Usable images of one split with their labels.

    Attributes:
        paths: image files, length n.
        shapes: int32 [n, 2] upright `(height, width)` of each original image.
        labels: n float32 arrays [G, 5] of `(class, x1, y1, x2, y2)` in original pixels.
        names: class names; index = class id.
        problems: every file that was excluded, fixed or used as a background.
        category_ids: COCO only: the json category id of each class index.
        image_ids: COCO only: the json image id of each image.
        store: shards only (`yolokit.data.store.stream.ShardStore`): where the images' bytes are read;
            `paths` then names each image (the split's url and its key) but is no file.
        items: shards only: each image's item in `store`.
        segments: a set with polygon rows (instance segmentation): each label row's polygon in original
            pixels, or none for a box row (no mask), flat (:class:`Segments`); None for a set without any.
    """

    paths: list[str]
    shapes: np.ndarray
    labels: list[np.ndarray]
    names: list[str]
    problems: list[Problem] = field(default_factory=list)
    category_ids: list[int] | None = None
    image_ids: list[int] | None = None
    store: Any = None
    items: np.ndarray | None = None
    segments: Segments | None = None

    def __len__(self) -> int:
        return len(self.paths)

    def image_bytes(self, i: int) -> np.ndarray:
        """The encoded bytes of image ``i`` as uint8 [N], from its file or its shard.

        Raises:
            ImageError: unreadable (a shard's: `ShardLost`, naming the chunk skipped).
        """
        if self.store is None:
            return read_bytes(self.paths[i])
        return self.store.read(int(self.items[i]))

    def stamp(self, i: int) -> str:
        """Shards: what names image ``i``'s content (its item and its chunk), for the disk cache."""
        return self.store.stamp(int(self.items[i]))

    @property
    def groups(self) -> np.ndarray | None:
        """Shards: the chunk of each image (the sampler shuffles within chunks); None for files."""
        return None if self.store is None else np.asarray(self.store.chunk_of(self.items))


def empty_labels() -> np.ndarray:
    """float32 [0, 5]."""
    return np.zeros((0, 5), np.float32)


def parse_yolo_labels(
    text: str, shape: tuple[int, int], num_classes: int
) -> tuple[np.ndarray, list[str]]:
    """Parse and repair the rows of one YOLO label file.

    Rows are `class cx cy w h` normalized to [0, 1]; a row `class x1 y1 x2 y2 ...` with
    three or more points (a segmentation polygon) is turned into its bounding box.

    Args:
        text: the file's content.
        shape: upright image `(height, width)` in pixels.
        num_classes: valid class ids are 0..num_classes-1.

    Returns:
        labels: float32 [G, 5] `(class, x1, y1, x2, y2)` in pixels, unique rows.
        fixes: what was repaired or dropped, one phrase per kind of problem.
    """
    labels, _, fixes = parse_yolo_segments(text, shape, num_classes)
    return labels, fixes


def parse_yolo_segments(
    text: str, shape: tuple[int, int], num_classes: int
) -> tuple[np.ndarray, list[np.ndarray | None], list[str]]:
    """:func:`parse_yolo_labels`, keeping each polygon row's points.

    A polygon row (`class x1 y1 x2 y2 ...`, three points or more) gives its bounding box and its
    points; a box row (`class cx cy w h`) gives no polygon (no mask). Rows are repaired and dropped
    as :func:`parse_yolo_labels` does, the polygons with their rows; a polygon's points are clipped
    to the image as its box is.

    Returns:
        labels: float32 [G, 5] as :func:`parse_yolo_labels`.
        polygons: G entries, float32 [K, 2] `(x, y)` points in pixels for a polygon row, None for a box row.
        fixes: what was repaired or dropped.
    """
    rows, points, lines, bad_text = [], [], [], []
    for number, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        try:
            vals = [float(v) for v in parts]
        except ValueError:
            bad_text.append(f"row {number}: not numbers")
            continue
        lines.append(number)
        if len(vals) == 5:
            c, cx, cy, w, h = vals
            if w < 0 or h < 0:  # kept as NaN so the finite check below drops it
                rows.append((c, np.nan, np.nan, np.nan, np.nan, 1.0))
            else:
                rows.append((c, cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2, 0.0))
            points.append(None)
        elif len(vals) >= 7 and len(vals) % 2 == 1:
            xy = np.array(vals[1:], np.float64).reshape(-1, 2)
            rows.append((vals[0], *xy.min(0), *xy.max(0), 0.0))
            points.append(xy)
        else:
            lines.pop()
            bad_text.append(f"row {number}: {len(vals) - 1} values after the class, neither a box (4) nor a "
                            "polygon (x y pairs, 3 points or more)")
    fixes = []
    if bad_text:
        fixes.append(f"{len(bad_text)} malformed row(s) dropped ({'; '.join(bad_text[:3])}"
                     f"{'; ...' if len(bad_text) > 3 else ''})")
    if not rows:
        return empty_labels(), [], fixes
    arr = np.array(rows, np.float64)
    kept = np.arange(len(arr))
    negative = arr[:, 5] > 0
    arr = arr[:, :5]
    if negative.any():
        fixes.append(f"{int(negative.sum())} row(s) with negative size dropped")
    finite = np.isfinite(arr).all(1) & np.array([p is None or bool(np.isfinite(p).all()) for p in points])
    if (~finite & ~negative).any():
        fixes.append(f"{int((~finite & ~negative).sum())} row(s) with NaN/inf dropped")
    arr, kept = arr[finite], kept[finite]
    cls = arr[:, 0]
    good_cls = (cls == np.round(cls)) & (cls >= 0) & (cls < num_classes)
    if (~good_cls).any():
        bad = sorted({float(c) for c in cls[~good_cls]})
        shown = ", ".join(f"{c:g}" for c in bad[:5])
        fixes.append(f"{int((~good_cls).sum())} row(s) with class id outside "
                     f"0..{num_classes - 1} ({shown}) dropped")
    arr, kept = arr[good_cls], kept[good_cls]
    # beyond rounding noise of 6-decimal label files counts as outside
    outside = ((arr[:, 1:] < -_TOL) | (arr[:, 1:] > 1 + _TOL)).any(1)
    if outside.any():
        which = [lines[i] for i in kept[outside]]
        fixes.append(f"{int(outside.sum())} row(s) outside [0, 1] clipped (row{'s' if len(which) > 1 else ''} "
                     f"{', '.join(map(str, which[:5]))}{', ...' if len(which) > 5 else ''})")
    arr[:, 1:] = arr[:, 1:].clip(0, 1)
    h, w = shape
    arr[:, [1, 3]] *= w
    arr[:, [2, 4]] *= h
    arr, keep = _drop_degenerate_and_duplicates(arr, fixes)
    scale = np.array([w, h], np.float64)
    polygons = [None if points[i] is None else (points[i].clip(0, 1) * scale).astype(np.float32)
                for i in kept[keep]]
    return arr, polygons, fixes


def _drop_degenerate_and_duplicates(arr: np.ndarray, fixes: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Drop boxes under 1 px wide or high and exact duplicate rows (first one kept): the rows left and
    their indices in ``arr``."""
    ok = ((arr[:, 3] - arr[:, 1]) >= 1) & ((arr[:, 4] - arr[:, 2]) >= 1)
    if (~ok).any():
        fixes.append(f"{int((~ok).sum())} degenerate box(es) under 1 px dropped")
    index = np.flatnonzero(ok)
    arr = arr[ok].astype(np.float32)
    if len(arr) > 1:                        # a dict of row bytes: far cheaper than np.unique(axis=0)
        first: dict[bytes, int] = {}
        keep = [i for i, row in enumerate(arr) if first.setdefault(row.tobytes(), i) == i]
        if len(keep) < len(arr):
            fixes.append(f"{len(arr) - len(keep)} duplicate row(s) removed")
            arr, index = arr[keep], index[keep]
    return arr.reshape(-1, 5), index


def clean_pixel_boxes(arr: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, list[str]]:
    """Clip pixel rows `(class, x1, y1, x2, y2)` to the image, drop degenerate and duplicates.

    Args:
        arr: float [G, 5] in pixels (class ids assumed valid).
        shape: `(height, width)`.

    Returns:
        float32 [G', 5] and the list of fixes applied.
    """
    labels, _, fixes = clean_pixel_rows(arr, shape)
    return labels, fixes


def clean_pixel_rows(arr: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """:func:`clean_pixel_boxes`, with the index in ``arr`` of each row kept (int64 [G'])."""
    fixes = []
    arr = np.asarray(arr, np.float64).reshape(-1, 5)
    finite = np.isfinite(arr).all(1)
    if (~finite).any():
        fixes.append(f"{int((~finite).sum())} box(es) with NaN/inf dropped")
    arr, index = arr[finite], np.flatnonzero(finite)
    h, w = shape
    lim = np.array([w, h, w, h], np.float64)
    outside = ((arr[:, 1:] < 0) | (arr[:, 1:] > lim)).any(1)
    if outside.any():
        fixes.append(f"{int(outside.sum())} box(es) outside the image clipped")
    arr[:, 1:] = np.clip(arr[:, 1:], 0, lim)
    labels, keep = _drop_degenerate_and_duplicates(arr, fixes)
    return labels, index[keep].astype(np.int64), fixes


# ---------------------------------------------------------------------------- cache


def files_key(paths: list[str], *, extra: str = "") -> str:
    """Hash of file names, sizes and mtimes (missing files hash as missing).

    Args:
        paths: files whose change should invalidate the cache.
        extra: anything else the cached result depends on (class count, version).

    Returns:
        hex digest.
    """
    h = hashlib.sha256(f"v{CACHE_VERSION}|{extra}".encode())
    for p in paths:
        try:
            st = os.stat(p)
            h.update(f"{p}|{st.st_size}|{st.st_mtime_ns}\n".encode())
        except OSError:
            h.update(f"{p}|missing\n".encode())
    return h.hexdigest()


def save_index(path: Path, key: str, index: SplitIndex) -> bool:
    """Write the index atomically; returns False when the folder is not writable."""
    counts = np.array([len(x) for x in index.labels], np.int64)
    labels = np.concatenate(index.labels) if index.labels else empty_labels()
    problems = json.dumps([[p.path, p.reason, p.action] for p in index.problems])
    meta = json.dumps({"version": CACHE_VERSION, "key": key, "names": index.names,
                       "category_ids": index.category_ids,
                       "image_ids": index.image_ids})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, meta=np.array(meta), problems=np.array(problems),
                     paths=np.array(index.paths, dtype=str),
                     shapes=np.asarray(index.shapes, np.int32).reshape(-1, 2),
                     counts=counts, labels=labels.astype(np.float32),
                     **(index.segments.arrays() if index.segments is not None else {}))
        os.replace(tmp, path)
    except OSError:
        return False
    return True


def load_index(path: Path, key: str) -> SplitIndex | None:
    """Read a cached index; None when absent, stale (other key) or unreadable."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if meta.get("version") != CACHE_VERSION or meta.get("key") != key:
                return None
            counts = z["counts"]
            labels = np.split(z["labels"], np.cumsum(counts)[:-1]) if len(counts) else []
            index = SplitIndex(
                paths=[str(p) for p in z["paths"]],
                shapes=z["shapes"].astype(np.int32).reshape(-1, 2),
                labels=[np.ascontiguousarray(x, np.float32).reshape(-1, 5) for x in labels],
                names=list(meta["names"]),
                problems=[Problem(*p) for p in json.loads(str(z["problems"]))],
                category_ids=meta.get("category_ids"),
                image_ids=meta.get("image_ids"),
                segments=Segments.from_arrays(z),
            )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return index


def cache_home() -> Path:
    """yolokit's cache folder: $YOLOKIT_CACHE, else ~/.cache/yolokit."""
    env = os.environ.get("YOLOKIT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "yolokit"


# ---------------------------------------------------------------------------- report


def report(index: SplitIndex, where: str) -> str:
    """Log each problem file once and return the summary line (also logged).

    Excluded and fixed files are logged as warnings; background images (missing or
    empty label files) at info level. The summary is a warning when anything was
    excluded or fixed.
    """
    counts = {EXCLUDED: 0, FIXED: 0, BACKGROUND: 0}
    for p in index.problems:
        counts[p.action] = counts.get(p.action, 0) + 1
        level = logging.INFO if p.action == BACKGROUND else logging.WARNING
        logger.log(level, "%s: %s: %s", p.action, p.path, p.reason)
    n_boxes = sum(len(x) for x in index.labels)
    summary = (f"{where}: {len(index)} images, {n_boxes} boxes, "
               f"{counts[BACKGROUND]} backgrounds, {counts[FIXED]} label files fixed, "
               f"{counts[EXCLUDED]} images excluded")
    bad = counts[EXCLUDED] + counts[FIXED]
    logger.log(logging.WARNING if bad else logging.INFO, "%s", summary)
    return summary
