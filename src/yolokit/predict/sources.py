"""What a prediction reads: every image and frame a source names, one at a time.

A source is a file (image or video), a folder (searched recursively), a glob, a ``.txt``
file listing paths, one split of shards (its folder or ``s3://bucket/prefix/split``), the image
files under an ``s3://`` prefix, an image in memory (numpy, PIL, Tensor[3, H, W]) or a
Tensor[B, 3, H, W], a camera index, a stream URL OpenCV can open, or a list of any of
these. ``frames(source)`` yields ``Frame``s lazily: a folder of a million images costs
one decoded image at a time.

Each frame carries ``name``, the path its outputs get inside a run folder: the file's
path relative to the source's root (the folder, the glob's fixed part, the common
parent of listed files), so that same-named files of two folders stay apart.
"""

from __future__ import annotations

import glob as globlib
import json
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
from torch import Tensor

from yolokit.data.sources.images import (
    ImageError,
    bgr_to_tensor,
    decode_image,
    image_tensor,
    is_image_file,
    read_image,
    read_video,
)
from yolokit.data.store.stream import is_shards

VIDEO_SUFFIXES = frozenset({".asf", ".avi", ".m4v", ".mkv", ".mov", ".mp4", ".mpeg", ".mpg", ".ts", ".webm",
                            ".wmv"})
STREAM_PREFIXES = ("rtsp://", "rtmp://", "http://", "https://", "udp://", "tcp://")


@dataclass
class Frame:
    """One image to predict on.

    Attributes:
        image: Tensor[3, H, W] uint8 RGB.
        path: where it came from: a file path, a stream URL, ``camera<i>`` or ``image<i>``.
        name: relative POSIX path of its outputs in a run folder (``"sub/a.jpg"``,
            ``"clip.mp4"``); all frames of a video share it.
        frame: index of the frame in its video or stream; None for a still image.
        fps: the video's frame rate (None for stills; 30 when OpenCV does not say).
        frames: the video's frame count when known, else None.
    """

    image: Tensor
    path: str
    name: str
    frame: int | None = None
    fps: float | None = None
    frames: int | None = None

    @property
    def is_video(self) -> bool:
        return self.frame is not None


def is_video_file(path: str | os.PathLike) -> bool:
    """True when the file name has a video suffix OpenCV usually reads."""
    return Path(path).suffix.lower() in VIDEO_SUFFIXES


def frames(source: Any, *, vid_stride: int = 1) -> Iterator[Frame]:
    """Every image and video frame ``source`` names, in order, decoded one at a time.

    Args:
        source: see the module docstring.
        vid_stride: keep every n-th frame of videos and streams.

    Raises:
        FileNotFoundError: a path that does not exist, a folder or glob with no image
            or video (the message names it).
        ValueError: a file named directly that cannot be decoded, a camera or stream
            OpenCV cannot open.
    """
    if isinstance(source, Tensor) and source.ndim == 4:
        source = list(source)
    if isinstance(source, (list, tuple)):
        yield from _many(source, vid_stride)
    elif _is_path_like(source):
        root = _root_of([source])
        yield from _one_path(source, root, vid_stride, counter=[0])
    else:
        yield Frame(image_tensor(source), "image0", "image0.jpg")


def _is_path_like(source: Any) -> bool:
    return isinstance(source, (str, Path, int)) and not isinstance(source, bool)


def _many(sources: Sequence[Any], vid_stride: int) -> Iterator[Frame]:
    """Paths relative to their common root; in-memory images named image<i>.jpg by position."""
    root = _root_of([s for s in sources if _is_path_like(s)])
    counter = [0]
    for i, source in enumerate(sources):
        if _is_path_like(source):
            yield from _one_path(source, root, vid_stride, counter)
        else:
            yield Frame(image_tensor(source), f"image{i}", f"image{i}.jpg")


def _is_stream(source: Any) -> bool:
    return isinstance(source, int) or (isinstance(source, str) and (source.isdigit()
                                                                    or source.lower().startswith(STREAM_PREFIXES)))


def _root_of(paths: Sequence[Any]) -> Path:
    """The folder output names are relative to: the common parent of the given paths."""
    anchors = []
    for p in paths:
        if _is_stream(p):
            continue
        p = str(p)
        if globlib.has_magic(p):
            anchors.append(_glob_base(p))
        else:
            path = Path(p).resolve()
            anchors.append(path if path.is_dir() else path.parent)
    if not anchors:
        return Path.cwd()
    try:
        return Path(os.path.commonpath([str(a) for a in anchors]))
    except ValueError:  # different drives
        return Path(anchors[0].anchor)


def _glob_base(pattern: str) -> Path:
    """The longest leading part of a glob pattern without wildcards, as an absolute folder."""
    parts = []
    for part in Path(pattern).parts:
        if globlib.has_magic(part):
            break
        parts.append(part)
    return Path(*parts).resolve() if parts else Path.cwd()


def _relative(path: Path, root: Path) -> str:
    try:
        return PurePosixPath(path.resolve().relative_to(root)).as_posix()
    except ValueError:
        return path.name


def _one_path(source: str | Path | int, root: Path, vid_stride: int, counter: list[int]) -> Iterator[Frame]:
    if _is_stream(source):
        index = counter[0]
        counter[0] += 1
        name = f"camera{source}.mp4" if isinstance(source, int) or str(source).isdigit() else f"stream{index}.mp4"
        target = int(source) if isinstance(source, int) or str(source).isdigit() else str(source)
        yield from _video(target, str(source), name, vid_stride)
        return
    text = str(source)
    if is_shards(text):
        yield from _shards(text)
        return
    if globlib.has_magic(text):
        files = sorted(Path(p) for p in globlib.glob(text, recursive=True) if _is_media(p))
        if not files:
            raise FileNotFoundError(f"no images or videos match {text}")
        yield from _files(files, root, vid_stride, strict=False)
        return
    path = Path(text)
    if path.is_dir():
        files = sorted((p for p in path.rglob("*") if p.is_file() and _is_media(p)),
                       key=lambda p: p.relative_to(path).as_posix())
        if not files:
            raise FileNotFoundError(f"no images or videos in folder {path} (images: .jpg, .png, ...; videos: "
                                    f"{', '.join(sorted(VIDEO_SUFFIXES))})")
        yield from _files(files, root, vid_stride, strict=False)
    elif path.is_file() and path.suffix.lower() == ".txt":
        files = list_file(path)
        yield from _files(files, _root_of(files), vid_stride, strict=False)
    elif path.is_file():
        yield from _files([path], root, vid_stride, strict=True)
    else:
        raise FileNotFoundError(f"image source not found: {path}")


def list_file(path: str | os.PathLike) -> list[Path]:
    """The paths a ``.txt`` file lists, one a line (blank and ``#`` lines skipped), relative to its folder."""
    path = Path(path)
    base = path.parent
    files = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            p = Path(line)
            files.append(p if p.is_absolute() else base / p)
    if not files:
        raise FileNotFoundError(f"{path} lists no files")
    return files


def _is_media(path: str | os.PathLike) -> bool:
    return is_image_file(path) or is_video_file(path)


def _files(files: Sequence[Path], root: Path, vid_stride: int, *, strict: bool) -> Iterator[Frame]:
    """Images and videos from a list of files; unreadable images are skipped with a warning
    unless ``strict`` (a file named directly)."""
    for path in files:
        name = _relative(path, root)
        if is_video_file(path):
            yield from _video(str(path), str(path), name, vid_stride)
            continue
        try:
            if not path.is_file():
                raise ImageError("file not found")
            bgr = read_image(path)
        except ImageError as err:
            if strict:
                raise ValueError(f"cannot read image {path}: {err}") from err
            warnings.warn(f"skipped {path}: {err}", stacklevel=2)
            continue
        yield Frame(bgr_to_tensor(bgr), str(path), name)


def _shards(url: str) -> Iterator[Frame]:
    """The images of one split of shards (`yolokit data shard`), named by their keys; those of a chunk that
    cannot be read are skipped (the chunk named once)."""
    from yolokit.data.store.remote import Place
    from yolokit.data.store.stream import LABELS, MANIFEST, ShardLost, shard_index

    place = Place(url)
    if place.size(LABELS) is None:
        try:
            splits = list(json.loads(place.read(MANIFEST))["splits"])
        except FileNotFoundError:
            if place.remote:
                yield from _stored_images(place)
                return
            raise FileNotFoundError(f"no finished shards at {url}") from None
        raise FileNotFoundError(f"{url} holds the splits {', '.join(splits)} as shards: name one, e.g. "
                                f"{url.rstrip('/')}/{splits[-1] if splits else 'val'}")
    index = shard_index(url, names=[])
    for i in range(len(index)):
        try:
            bgr = decode_image(index.image_bytes(i))
        except ShardLost:
            continue
        except ImageError as err:
            warnings.warn(f"skipped {index.paths[i]}: {err}", stacklevel=2)
            continue
        yield Frame(bgr_to_tensor(bgr), index.paths[i], index.paths.key(i))


def _stored_images(place: Any) -> Iterator[Frame]:
    """The image files under an ``s3://`` prefix that holds no shards, in key order, named by their keys
    under it; an unreadable one is skipped with a warning (videos are not read from a store)."""
    names = [n for n in place.names() if is_image_file(n)]
    if not names:
        raise FileNotFoundError(f"{place.url}: no shards and no images there (shards: `yolokit data shard`)")
    for name in names:
        try:
            bgr = decode_image(np.frombuffer(place.read(name), np.uint8))
        except (ImageError, FileNotFoundError) as err:
            warnings.warn(f"skipped {place.where(name)}: {err}", stacklevel=2)
            continue
        yield Frame(bgr_to_tensor(bgr), place.where(name), name)


def _video(target: str | int, path: str, name: str, vid_stride: int) -> Iterator[Frame]:
    """Frames of a video file, camera or stream (``yolokit.data.sources.images.read_video``)."""
    for f in read_video(target, vid_stride=vid_stride):
        yield Frame(bgr_to_tensor(f.bgr), path, name, frame=f.index, fps=f.fps / vid_stride, frames=f.count)
