"""Write a dataset as shards: `write_shards(src, out)`, `yolokit data shard SRC OUT`.

The shards are litdata's chunked format (the `stream` extra), one dataset per split, so any
litdata reader can stream them; yolokit adds a label index beside each split so that training
knows every image's size and boxes before it reads a byte of pixels::

    OUT/yolokit-shards.json     class names, the splits and what was written or left out
    OUT/data.yaml               names the splits: `yolokit train --data OUT/data.yaml` (or `--data OUT`)
    OUT/<split>/index.json      litdata's index of the chunks
    OUT/<split>/chunk-0-K.bin   items {"image": the file's bytes as on disk, "key": its path in the
                                source, "labels": float32 [G, 5] (class, x1, y1, x2, y2) in its pixels}
    OUT/<split>/labels.npz      the label index: sizes, labels and keys of every item, in item order
    OUT/<split>/progress.json   what is written so far; writing again into OUT continues from it

OUT is a local folder or ``s3://bucket/prefix`` (credentials and endpoint from the standard AWS
variables). Each chunk is committed (uploaded, its labels saved, then progress.json) before the next
one is started, so an interrupted write loses at most the chunk under way: writing again checks the
chunks already listed (one cut short is named, counted and written again) and goes on from there.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from yolokit.data.sources.images import ImageError, read_bytes
from yolokit.data.sources.labels import EXCLUDED, Problem, SplitIndex
from yolokit.data.sources.readers import DatasetError, load_split, read_data_yaml
from yolokit.data.sources.segments import Segments
from yolokit.data.store.remote import Place, allow_plain_http, join
from yolokit.data.store.stream import LABELS, MANIFEST

logger = logging.getLogger("yolokit.data")

PROGRESS = "progress.json"
FORMAT = "yolokit-shards/1"


@dataclass
class ShardSummary:
    """What one split's writing did.

    Attributes:
        split: the split's name.
        url: where its shards are.
        images: items in the shards now.
        chunks: chunk files.
        written: items written by this call (0: it was complete already).
        problems: images of the source left out (unreadable; named), and chunks found cut short.
    """

    split: str
    url: str
    images: int
    chunks: int
    written: int
    problems: list[Problem] = field(default_factory=list)


def _require_engine():
    try:
        from litdata.streaming.writer import BinaryWriter
    except ImportError as err:
        raise ImportError("shards need the streaming engine: pip install 'yolokit[stream]' (litdata)") from err
    return BinaryWriter


def _keys(index: SplitIndex, root: Path | None) -> list[str]:
    out = []
    for p in index.paths:
        try:
            out.append(Path(p).resolve().relative_to(root).as_posix() if root else Path(p).name)
        except ValueError:
            out.append(Path(p).name)
    return out


def _npz(**arrays) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _label_part(keys: list[str], shapes: list, labels: list[np.ndarray], image_ids: list[int] | None,
                segments: Segments | None = None) -> dict:
    """A chunk's label index (and its images' polygons, for a segmentation set)."""
    blobs = [k.encode() for k in keys]
    counts = np.array([len(x) for x in labels], np.int64)
    return dict(shapes=np.array(shapes, np.int32).reshape(-1, 2),
                label_offsets=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
                labels=(np.concatenate(labels) if labels else np.zeros((0, 5))).astype(np.float32).reshape(-1, 5),
                keys=np.frombuffer(b"".join(blobs), np.uint8).copy(),
                key_offsets=np.concatenate([[0], np.cumsum([len(b) for b in blobs])]).astype(np.int64),
                image_ids=np.array(image_ids if image_ids is not None else [], np.int64),
                **(segments.arrays() if segments is not None else {}))


def _merge_parts(parts: list[dict]) -> dict:
    """One label index from the parts of consecutive chunks."""
    out = {"shapes": np.concatenate([p["shapes"] for p in parts]).reshape(-1, 2),
           "labels": np.concatenate([p["labels"] for p in parts]).reshape(-1, 5),
           "keys": np.concatenate([p["keys"] for p in parts]),
           "image_ids": np.concatenate([p["image_ids"] for p in parts])}
    for name, base in (("label_offsets", "labels"), ("key_offsets", "keys")):
        offsets, at = [np.zeros(1, np.int64)], 0
        for p in parts:
            offsets.append(p[name][1:] + at)
            at += len(p[base])
        out[name] = np.concatenate(offsets)
    if "segment_bounds" in parts[0]:
        out.update(Segments.concat([Segments.from_arrays(p) for p in parts]).arrays())
    return out


def _read_part(place: Place, k: int, chunks: list[dict], finished: dict) -> dict:
    """The label index of chunk ``k``: its part file while a write is under way, else cut out of the
    finished split's labels.npz (a write that goes on after it had finished, from a chunk found cut short;
    read once into ``finished``)."""
    try:
        return dict(np.load(io.BytesIO(place.read(f"parts/labels-{k}.npz")), allow_pickle=False))
    except FileNotFoundError:
        if not finished:
            finished.update(np.load(io.BytesIO(place.read(LABELS)), allow_pickle=False))
        whole = finished
    first = sum(c["chunk_size"] for c in chunks[:k])
    last = first + chunks[k]["chunk_size"]
    lo, hi = whole["label_offsets"][first], whole["label_offsets"][last]
    klo, khi = whole["key_offsets"][first], whole["key_offsets"][last]
    ids, segments = whole["image_ids"], Segments.from_arrays(whole)
    return dict(shapes=whole["shapes"][first:last], labels=whole["labels"][lo:hi],
                label_offsets=whole["label_offsets"][first:last + 1] - lo, keys=whole["keys"][klo:khi],
                key_offsets=whole["key_offsets"][first:last + 1] - klo,
                image_ids=ids[first:last] if len(ids) else ids,
                **(segments.images(first, last).arrays() if segments is not None else {}))


def _source_key(keys: list[str], index: SplitIndex) -> str:
    h = hashlib.sha1("\n".join(keys).encode())
    h.update(json.dumps(index.names).encode())
    return h.hexdigest()


def _write_split(index: SplitIndex, keys: Sequence[str], place: Place, split: str, *, chunk_bytes: int | str,
                 log_every: int, read: Callable[[int], bytes] | None = None) -> ShardSummary:
    BinaryWriter = _require_engine()
    source = _source_key(keys, index)
    problems: list[Problem] = []
    try:
        progress = json.loads(place.read(PROGRESS))
    except FileNotFoundError:
        progress = None
    if progress is not None and progress.get("source") != source:
        raise DatasetError(f"{place.url} holds shards of another source (other images or class names); "
                           "write into an empty OUT, or delete it first")
    progress = progress or {"format": FORMAT, "source": source, "chunks": [], "consumed": [], "config": None,
                            "excluded": []}
    # chunks listed but cut short (an upload or a disk that stopped): named, counted, written again
    for k, info in enumerate(progress["chunks"]):
        size = place.size(info["filename"])
        if size != info["chunk_bytes"]:
            lost = sum(c["chunk_size"] for c in progress["chunks"][k:])
            problems.append(Problem(place.where(info["filename"]), f"shard cut short ({size or 0} of "
                                    f"{info['chunk_bytes']} bytes): its {lost} image(s) written again", EXCLUDED))
            logger.warning("%s: %s", problems[-1].path, problems[-1].reason)
            progress["chunks"], progress["consumed"] = progress["chunks"][:k], progress["consumed"][:k]
            break
    start = progress["consumed"][-1] if progress["consumed"] else 0
    items = sum(c["chunk_size"] for c in progress["chunks"])
    progress["excluded"] = [e for e in progress["excluded"] if e[0] < start]
    problems += [Problem(e[1], e[2], EXCLUDED) for e in progress["excluded"]]
    if start >= len(keys) and place.size("index.json") is not None and place.size(LABELS) is not None:
        return ShardSummary(split, place.url, items, len(progress["chunks"]), 0, problems)

    place.remove("index.json")                # unfinished again until the end (and litdata's writer stops at one)
    stage = Path(place.url) if not place.remote else Path(tempfile.mkdtemp(prefix="yolokit-shards-"))
    stage.mkdir(parents=True, exist_ok=True)
    writer = BinaryWriter(str(stage), chunk_bytes=chunk_bytes, chunk_index=len(progress["chunks"]))
    pending: list[tuple[int, int]] = []      # (item, source position) not yet in a committed chunk
    written = 0

    def commit(path: str) -> None:
        nonlocal pending
        info = writer._chunks_info[-1]
        n = int(info["chunk_size"])
        members, pending = pending[:n], pending[n:]
        if Path(path).name != info["filename"] or len(members) != n:
            raise RuntimeError(f"{path}: the writer's chunk does not match its items")
        part = _label_part([keys[s] for _, s in members], [index.shapes[s] for _, s in members],
                           [index.labels[s] for _, s in members],
                           [index.image_ids[s] for _, s in members] if index.image_ids is not None else None,
                           None if index.segments is None else index.segments.take(
                               [np.arange(index.segments.starts[s], index.segments.starts[s + 1]) for _, s in members]))
        place.write(f"parts/labels-{len(progress['chunks'])}.npz", _npz(**part))
        place.put_file(info["filename"], path)
        if place.remote:
            os.remove(path)
        progress["chunks"].append(info)
        progress["consumed"].append(members[-1][1] + 1)
        progress["config"] = writer.get_config()
        place.write(PROGRESS, json.dumps(progress).encode())

    try:
        item = items
        for s in range(start, len(keys)):
            try:
                data = read(s) if read is not None else read_bytes(index.paths[s]).tobytes()
            except ImageError as err:
                problems.append(Problem(index.paths[s], f"not written: {err}", EXCLUDED))
                logger.warning("%s: %s", index.paths[s], problems[-1].reason)
                progress["excluded"].append([s, index.paths[s], f"not written: {err}"])
                continue
            pending.append((item, s))
            done = writer.add_item(item, {"image": data, "key": keys[s],
                                          "labels": np.asarray(index.labels[s], np.float32).reshape(-1, 5)})
            item += 1
            written += 1
            if done:
                commit(done)
            if log_every and written % log_every == 0:
                logger.info("%s: %d / %d images written", place.url, s + 1, len(keys))
        for path in writer.done():
            if path:
                commit(path)
    finally:
        if place.remote:
            shutil.rmtree(stage, ignore_errors=True)
        else:
            for f in stage.glob("*.index.json"):      # the writer's own partial index: ours is index.json
                f.unlink(missing_ok=True)
    chunks = progress["chunks"]
    if not chunks:
        raise DatasetError(f"{place.url}: no image of split '{split}' could be written")
    finished: dict = {}
    parts = [_read_part(place, k, chunks, finished) for k in range(len(chunks))]
    place.write(LABELS, _npz(**_merge_parts(parts)))
    place.write("index.json", json.dumps({"chunks": chunks, "config": progress["config"]}, sort_keys=True).encode())
    for k in range(len(chunks)):                 # in labels.npz now (a later write cuts them out of it again)
        place.remove(f"parts/labels-{k}.npz")
    return ShardSummary(split, place.url, sum(c["chunk_size"] for c in chunks), len(chunks), written, problems)


def _splits_of(src: str | os.PathLike, splits: list[str] | None) -> tuple[list[str], Path | None, bool]:
    """The splits to write, the root keys are made relative to, and whether the source is a COCO json."""
    if str(src) in ("shapes", "shapes-seg"):
        from yolokit.data.sources.shapes import make_shapes

        src = make_shapes(segments=True) if str(src) == "shapes-seg" else make_shapes()
    path = Path(src)
    if path.suffix.lower() == ".json":
        return splits or ["train"], None, True
    if path.is_dir():
        path = path / "data.yaml"
    cfg = read_data_yaml(path)
    found = [s for s in ("train", "val", "test") if cfg.get(s)]
    return splits or found, cfg["path"], False


def _open_manifest(top: Place) -> dict:
    try:
        return json.loads(top.read(MANIFEST))
    except FileNotFoundError:                   # written first: a folder cut short is still known as shards
        manifest = {"format": FORMAT, "names": None, "splits": {}}
        top.write(MANIFEST, json.dumps(manifest, indent=1).encode())
        return manifest


def write_split(index: SplitIndex, out: str | os.PathLike, split: str, *, keys: Sequence[str],
                read: Callable[[int], bytes] | None = None, chunk_bytes: int | str = "64MB",
                log_every: int = 10000) -> ShardSummary:
    """Write one split given as a `SplitIndex` (images, sizes, labels, names) as shards under ``out/split``.

    What `write_shards` does for each split of a dataset; for images that are not files (generated,
    or from another store), pass ``read``. Writing again continues where a write stopped.

    Args:
        index: the split (`paths` are named in problems; `shapes`, `labels`, `names`, COCO ids).
        out: the shards' folder or ``s3://bucket/prefix`` (its manifest and data.yaml are updated).
        split: the split's name.
        keys: each image's key, kept in its item (its path relative to the dataset's root).
        read: image ``s``'s encoded bytes; default the file ``index.paths[s]``.
        chunk_bytes, log_every: as `write_shards`.
    """
    _require_engine()
    allow_plain_http()
    top = Place(out)
    top.check()
    manifest = _open_manifest(top)
    if manifest["names"] is not None and manifest["names"] != index.names:
        raise DatasetError(f"{out}: its shards have classes {manifest['names']}, the split {index.names}")
    manifest["names"] = index.names
    if index.category_ids is not None:
        manifest["category_ids"] = index.category_ids
    summary = _write_split(index, keys, Place(join(str(out), split)), split, chunk_bytes=chunk_bytes,
                           log_every=log_every, read=read)
    written = summary.problems                  # what writing found: unreadable images, chunks cut short
    summary.problems = [p for p in index.problems if p.action == EXCLUDED] + written
    manifest["splits"][split] = {"images": summary.images, "chunks": summary.chunks,
                                 "left_out": sum(p.action == EXCLUDED for p in summary.problems),
                                 "problems": [[p.path, p.reason, p.action] for p in index.problems + written]}
    top.write(MANIFEST, json.dumps(manifest, indent=1).encode())
    yaml_text = "".join(["path: .\n"] + [f"{s}: {s}\n" for s in manifest["splits"]]
                        + ["names:\n"] + [f"  {i}: {json.dumps(n)}\n" for i, n in enumerate(manifest["names"])])
    top.write("data.yaml", yaml_text.encode())
    return summary


def write_shards(src: str | os.PathLike, out: str | os.PathLike, *, splits: list[str] | None = None,
                 chunk_bytes: int | str = "64MB", image_dir: str | os.PathLike | None = None,
                 log_every: int = 10000) -> dict[str, ShardSummary]:
    """Write a YOLO-format dataset (its data.yaml or folder, "shapes" or "shapes-seg") or a COCO json as shards.

    Args:
        src: the source dataset.
        out: a local folder or ``s3://bucket/prefix``; writing again into it continues where a
            previous write stopped (the same source only).
        splits: the splits to write; default every one of train/val/test the data.yaml names (a
            COCO json is one split, "train" unless named here).
        chunk_bytes: the size of a chunk file ("64MB"; litdata's notation).
        image_dir: COCO only, the image folder.
        log_every: a progress line every this many images.

    Returns:
        a `ShardSummary` per split. Images left out are named in the log and in the summary.

    Examples:
        >>> out = write_shards("shapes", "/tmp/shapes-shards")   # doctest: +SKIP
        >>> out["train"].images, out["train"].chunks               # doctest: +SKIP
        (128, 1)
    """
    _require_engine()
    names, root, coco = _splits_of(src, splits)
    Place(out).check()                          # credentials refused: before any image is read
    summaries: dict[str, ShardSummary] = {}
    for split in names:
        index = load_split(src, split, image_dir=image_dir)
        summaries[split] = write_split(index, out, split, keys=_keys(index, root if not coco else None),
                                       chunk_bytes=chunk_bytes, log_every=log_every)
    return summaries
