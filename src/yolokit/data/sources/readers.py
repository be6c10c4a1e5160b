"""Dataset readers: YOLO folders with a data.yaml, COCO instances json, the shapes set.

Each reader returns a `SplitIndex` (labels.py): the usable images of one split with
their labels as `(class, x1, y1, x2, y2)` pixel rows, plus every problem found.
Indexes are cached beside the labels and rebuilt when any file changes.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import numpy as np
import yaml

from yolokit.data.sources.coco import annotation_polygon, check_coco_image
from yolokit.data.sources.images import ImageError, is_image_file, verify_image
from yolokit.data.sources.labels import (
    BACKGROUND,
    CACHE_SUFFIX,
    EXCLUDED,
    FIXED,
    Problem,
    SplitIndex,
    cache_home,
    empty_labels,
    files_key,
    load_index,
    parse_yolo_segments,
    report,
    save_index,
)
from yolokit.data.sources.segments import split_segments

_NOT_IMAGES = frozenset({".txt", ".json", ".yaml", ".yml", ".cache", ".md", ".csv", ".xml",
                         ".npy", ".npz", ".db", ".ini"})


class DatasetError(ValueError):
    """A dataset that cannot be used at all (no usable image, missing split...)."""


# ---------------------------------------------------------------------------- YOLO


def read_data_yaml(path: str | os.PathLike) -> dict:
    """Read an Ultralytics-style data.yaml.

    `path` (the dataset root) is resolved against the yaml's folder when relative
    (and against the working directory when that does not exist); it defaults to
    the yaml's folder. `names` may be a list or a `{id: name}` dict; with only `nc`
    the names are "0", "1", ... Keys such as `download` are ignored, never run.

    Returns:
        the yaml's dict with `path` an absolute Path and `names` a list of str.
    """
    path = Path(path)
    with open(path, encoding="utf-8") as f:
        cfg = yaml.safe_load(f) or {}
    if not isinstance(cfg, dict):
        raise DatasetError(f"{path}: not a data.yaml mapping")
    root = Path(cfg.get("path") or ".").expanduser()
    if not root.is_absolute():
        root = (path.parent / root) if (path.parent / root).exists() or not root.exists() else root
    cfg["path"] = root.resolve()
    names = cfg.get("names")
    if isinstance(names, dict):
        ids = {int(k): str(v) for k, v in names.items()}
        names = [ids.get(i, str(i)) for i in range(max(ids) + 1)] if ids else []
    elif names is None:
        names = [str(i) for i in range(int(cfg.get("nc", 0)))]
    cfg["names"] = [str(n) for n in names]
    if not cfg["names"]:
        raise DatasetError(f"{path}: no class names (give 'names' or 'nc')")
    return cfg


def label_path(image: str | os.PathLike) -> str:
    """The label file of an image: the last `/images/` becomes `/labels/`, suffix `.txt`."""
    image = str(image)
    sa, sb = f"{os.sep}images{os.sep}", f"{os.sep}labels{os.sep}"
    head, sep, tail = image.rpartition(sa)
    swapped = head + sb + tail if sep else image
    return os.path.splitext(swapped)[0] + ".txt"


def list_split(spec: str | list, root: Path) -> tuple[list[str], list[Problem]]:
    """Image files of a split given as a folder, a .txt list, an image, or a list of those.

    Relative entries are resolved against `root`; relative lines of a .txt list
    against the list's folder. Non-image files met in folders are reported.

    Returns:
        sorted unique image paths, and problems for unsupported files.
    """
    specs = spec if isinstance(spec, (list, tuple)) else [spec]
    files, problems = [], []
    for s in specs:
        p = Path(s).expanduser()
        p = p if p.is_absolute() else root / p
        if p.is_dir():
            for dirpath, dirnames, filenames in os.walk(p):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                for name in filenames:
                    full = os.path.join(dirpath, name)
                    if is_image_file(name):
                        files.append(full)
                    elif not name.startswith(".") and Path(name).suffix.lower() not in _NOT_IMAGES:
                        problems.append(Problem(full, "unsupported file type", EXCLUDED))
        elif p.suffix.lower() == ".txt" and p.is_file():
            for line in p.read_text(encoding="utf-8").splitlines():
                line = line.strip()
                if line:
                    q = Path(line).expanduser()
                    files.append(str(q if q.is_absolute() else (p.parent / q).resolve()))
        elif p.is_file():
            files.append(str(p))
        else:
            raise DatasetError(f"split path does not exist: {p}")
    return sorted(set(files)), problems


def _check_yolo_image(image: str, label: str, num_classes: int):
    try:
        shape = verify_image(image)
    except ImageError as err:
        return None, (None, None), Problem(image, str(err), EXCLUDED)
    try:
        with open(label, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return shape, (empty_labels(), None), Problem(image, f"no label file {label}", BACKGROUND)
    except (OSError, UnicodeDecodeError) as err:
        return None, (None, None), Problem(image, f"label file unreadable ({err})", EXCLUDED)
    labels, polygons, fixes = parse_yolo_segments(text, shape, num_classes)
    problem = (Problem(image, f"{label}: " + "; ".join(fixes), FIXED) if fixes else
               None if len(labels) else Problem(image, f"empty label file {label}", BACKGROUND))
    return shape, (labels, polygons), problem


T = TypeVar("T")
R = TypeVar("R")


def check_files(check: Callable[[T], R], items: Sequence[T], *, chunk: int = 64) -> list[R]:
    """``[check(x) for x in items]``, in one thread or a pool as the storage asks.

    Checking a file is mostly Python (a header, a label file parsed) and holds the GIL, so
    while the files come from the page cache, threads only contend for it (here 4 threads
    took 2.5x as long as one). The first ``chunk`` items are checked in this thread and
    timed: when the wall time is over twice the thread's CPU time, the scan is waiting on
    storage (a cold disk, a network file system) and the rest goes to a pool of threads, in
    chunks, so the waits overlap.
    """
    items = list(items)
    wall, cpu = time.perf_counter(), time.thread_time()
    out = [check(x) for x in items[:chunk]]
    waiting = time.perf_counter() - wall > 2 * (time.thread_time() - cpu) + 1e-3
    rest = [items[i:i + chunk] for i in range(chunk, len(items), chunk)]
    if waiting and len(rest) > 1:
        pool = ThreadPoolExecutor(min(8, (os.cpu_count() or 1) + 2))
        try:
            for part in pool.map(lambda c: [check(x) for x in c], rest):
                out.extend(part)
        finally:                                        # Ctrl-C: the chunks not started are not read
            pool.shutdown(wait=True, cancel_futures=True)
    else:
        out.extend(check(x) for part in rest for x in part)
    return out


def _build_yolo(images: list[str], names: list[str], problems: list[Problem]) -> SplitIndex:
    index = SplitIndex(paths=[], shapes=np.zeros((0, 2), np.int32), labels=[], names=names, problems=list(problems))
    shapes, polygons = [], []
    results = check_files(lambda im: _check_yolo_image(im, label_path(im), len(names)), images)
    for image, (shape, (labels, rows), problem) in zip(images, results, strict=True):
        if problem is not None:
            index.problems.append(problem)
        if shape is not None:
            index.paths.append(image)
            shapes.append(shape)
            index.labels.append(labels)
            polygons.append(rows)
    index.shapes = np.array(shapes, np.int32).reshape(-1, 2)
    index.segments = split_segments(polygons, [len(lb) for lb in index.labels])
    return index


def _cached(anchor: Path, key: str, build) -> SplitIndex:
    """Load the index cached at `anchor` (or the fallback cache) or build and store it."""
    fallback = cache_home() / "labels" / (files_key([str(anchor)])[:16] + CACHE_SUFFIX)
    for place in (anchor, fallback):
        index = load_index(place, key)
        if index is not None:
            return index
    index = build()
    if not save_index(anchor, key, index):
        save_index(fallback, key, index)
    return index


def _yolo_cache_path(spec: str | list, root: Path, first_label: str) -> Path:
    """Where a split's label cache lives.

    A folder split: beside its label folder (`labels/train` -> `labels/train.yolokit.cache`);
    a .txt list: beside the list; a list of entries: beside the first label folder, tagged
    with a hash of the list, so splits sharing a label folder do not overwrite each other.
    """
    folder = Path(first_label).parent
    if isinstance(spec, (list, tuple)):
        tag = files_key([str(s) for s in spec])[:8]
        return folder.parent / f"{folder.name}.{tag}{CACHE_SUFFIX}"
    txt = Path(spec).expanduser()
    txt = txt if txt.is_absolute() else root / txt
    if txt.suffix.lower() == ".txt" and txt.is_file():
        return txt.parent / f"{txt.stem}{CACHE_SUFFIX}"
    return folder.parent / f"{folder.name}{CACHE_SUFFIX}"


def yolo_index(data_yaml: str | os.PathLike, split: str, *, cache: bool = True,
               shards: dict | None = None) -> SplitIndex:
    """Index one split of a YOLO-format dataset.

    Args:
        data_yaml: the dataset's data.yaml.
        split: "train", "val", "test" or any other key of the yaml.
        cache: read and write the label cache (beside the labels, else in cache_home()).

    Returns:
        the checked SplitIndex (problems logged, summary logged).

    Raises:
        DatasetError: unknown split, missing paths, or no usable image.
    """
    cfg = read_data_yaml(data_yaml)
    if not cfg.get(split):
        raise DatasetError(f"{data_yaml}: no '{split}' split")
    from yolokit.data.store.stream import is_shards, shard_index

    spec = cfg[split] if not isinstance(cfg[split], str) or "://" in cfg[split] else str(cfg["path"] / cfg[split])
    if isinstance(spec, str) and is_shards(spec):   # the split is shards: a folder of them, or s3://...
        return shard_index(spec, names=cfg["names"], **(shards or {}))
    images, problems = list_split(cfg[split], cfg["path"])
    where = f"{split} ({cfg[split]} in {cfg['path']})"
    if not images:
        raise DatasetError(f"no images found for split {where}")
    labels = [label_path(p) for p in images]
    key = files_key(images + labels, extra=f"yolo|nc={len(cfg['names'])}|{cfg['names']}")
    anchor = _yolo_cache_path(cfg[split], cfg["path"], labels[0])

    def build() -> SplitIndex:
        return _build_yolo(images, cfg["names"], problems)

    index = _cached(anchor, key, build) if cache else build()
    report(index, where)
    if len(index) == 0:
        raise DatasetError(f"no usable images in split {where}; see the warnings above")
    return index


# ---------------------------------------------------------------------------- COCO


def _coco_image_dir(json_path: Path, first_file: str | None) -> Path:
    stem = json_path.stem.split("_")[-1]  # instances_val2017 -> val2017
    parent = json_path.parent
    candidates = [parent / stem, parent.parent / stem, parent.parent / "images" / stem,
                  parent / "images", parent.parent / "images", parent, parent.parent]
    for c in candidates:
        if first_file is not None and (c / first_file).is_file():
            return c
    return parent


def coco_index(json_path: str | os.PathLike, *, image_dir: str | os.PathLike | None = None,
               cache: bool = True) -> SplitIndex:
    """Index a COCO instances json.

    Category ids are mapped, sorted, to contiguous class indices 0..K-1; the json id
    of each index is kept in `category_ids` (and each image's id in `image_ids`) for
    evaluation. `iscrowd` annotations are left out of the targets. Polygons (``segmentation``) give
    the index's `segments` (`yolokit.data.sources.coco`), when any annotation has one.

    Args:
        json_path: the instances json.
        image_dir: folder the `file_name`s are relative to; guessed when None
            (`val2017/`, `../val2017/`, `../images/val2017/`, `images/`, the json's folder).
        cache: read and write the index cache beside the json.

    Raises:
        DatasetError: no usable image.
    """
    json_path = Path(json_path)
    with open(json_path, encoding="utf-8") as f:
        data = json.load(f)
    cats = sorted(data.get("categories", []), key=lambda c: c["id"])
    cat_index = {c["id"]: i for i, c in enumerate(cats)}
    entries = data.get("images", [])
    first = entries[0]["file_name"] if entries else None
    root = Path(image_dir) if image_dir is not None else _coco_image_dir(json_path, first)
    paths = [str(root / e["file_name"]) for e in entries]
    key = files_key([str(json_path)] + paths, extra=f"coco|polygons-rle|{root}")   # RLE outlines: caches rebuilt

    def build() -> SplitIndex:
        anns, outlines, unknown, notes = defaultdict(list), defaultdict(list), defaultdict(int), defaultdict(list)
        sizes = {e["id"]: (e.get("height", 0), e.get("width", 0)) for e in entries}
        for a in data.get("annotations", []):
            if a.get("iscrowd", 0):
                continue
            if a.get("category_id") not in cat_index:
                unknown[a.get("image_id")] += 1
                continue
            anns[a["image_id"]].append([cat_index[a["category_id"]], *a["bbox"][:4]])
            outline, note = annotation_polygon(a, sizes.get(a["image_id"], (0, 0)))
            outlines[a["image_id"]].append(outline)
            if note:
                notes[a["image_id"]].append(note)
        index = SplitIndex(paths=[], shapes=np.zeros((0, 2), np.int32), labels=[],
                           names=[str(c["name"]) for c in cats],
                           category_ids=[int(c["id"]) for c in cats], image_ids=[])
        jobs = [(p, (e.get("height", 0), e.get("width", 0)), anns.get(e["id"], []), outlines.get(e["id"], []),
                 unknown.get(e["id"], 0), notes.get(e["id"], [])) for p, e in zip(paths, entries, strict=True)]
        shapes, polygons = [], []
        results = check_files(lambda j: check_coco_image(*j), jobs)
        for (path, *_), e, (shape, labels, rows, problem) in zip(jobs, entries, results, strict=True):
            if problem is not None:
                index.problems.append(problem)
            if shape is not None:
                index.paths.append(path)
                index.labels.append(labels)
                index.image_ids.append(int(e["id"]))
                shapes.append(shape)
                polygons.append(rows)
        index.shapes = np.array(shapes, np.int32).reshape(-1, 2)
        index.segments = split_segments(polygons, [len(lb) for lb in index.labels])
        return index

    anchor = json_path.with_suffix(CACHE_SUFFIX)
    index = _cached(anchor, key, build) if cache else build()
    report(index, f"{json_path} (images in {root})")
    if len(index) == 0:
        raise DatasetError(f"no usable images for {json_path} (images in {root})")
    return index


# ---------------------------------------------------------------------------- dispatch


def load_split(source: str | os.PathLike, split: str = "train", *,
               image_dir: str | os.PathLike | None = None, cache: bool = True,
               shards: dict | None = None) -> SplitIndex:
    """Index a split of any supported source.

    Args:
        source: a data.yaml path, a COCO instances json path, "shapes" or "shapes-seg" (`make_shapes`' built-in
            set, by boxes or outlines), or shards (`yolokit data shard`): their folder or ``s3://bucket/prefix``.
        split: split name for yaml sources; ignored for a json.
        image_dir: COCO only, the image folder.
        cache: use the label cache.
        shards: for shards, `shard_index`'s ``cache_dir`` and ``max_cache``.

    Returns:
        SplitIndex.
    """
    from yolokit.data.sources.shapes import make_shapes
    from yolokit.data.store.stream import is_shards, shard_index, shards_root_split

    made = {"shapes": make_shapes, "shapes-seg": lambda: make_shapes(segments=True)}.get(str(source))
    source = made() if made else source
    if is_shards(source):         # s3://bucket/prefix, or a folder of shards (`yolokit data shard`)
        return shard_index(shards_root_split(str(source), split), **(shards or {}))
    path = Path(source)
    if not path.exists():
        raise DatasetError(f"dataset source not found: {path}")
    if path.suffix.lower() == ".json":
        return coco_index(path, image_dir=image_dir, cache=cache)
    if path.is_dir() and (path / "data.yaml").is_file():
        path = path / "data.yaml"
    return yolo_index(path, split, cache=cache, shards=shards)
