"""The polygons of a split's label rows (instance segmentation), kept flat: a few arrays for the whole split, not
one Python object per polygon, so that a large set costs its points' bytes and loader workers share them as they
share the boxes."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Segments:
    """Each label row's polygon, rows image-major in the order of the split's ``labels``.

    Attributes:
        starts: int64 [n + 1], image i's rows are ``starts[i]:starts[i + 1]``.
        bounds: int64 [R + 1], row r's points are ``points[bounds[r]:bounds[r + 1]]``.
        boxes: bool [R], True for a box row (no polygon, no mask).
        points: float32 [P, 2] ``(x, y)`` in original pixels.
    """

    starts: np.ndarray
    bounds: np.ndarray
    boxes: np.ndarray
    points: np.ndarray

    @classmethod
    def from_images(cls, images: Sequence[Sequence[np.ndarray | None]]) -> Segments:
        """From each image's rows: a polygon float [K, 2], or None for a box row."""
        rows = [p for image in images for p in image]
        sizes = np.array([0 if p is None else len(p) for p in rows], np.int64)
        points = [np.asarray(p, np.float32).reshape(-1, 2) for p in rows if p is not None]
        return cls(starts=np.r_[0, np.cumsum([len(image) for image in images], dtype=np.int64)].astype(np.int64),
                   bounds=np.r_[0, np.cumsum(sizes)].astype(np.int64),
                   boxes=np.array([p is None for p in rows], bool).reshape(-1),
                   points=np.concatenate(points) if points else np.zeros((0, 2), np.float32))

    def __len__(self) -> int:
        return len(self.starts) - 1

    def extents(self, i: int) -> np.ndarray:
        """Image i's rows' extents: float32 [G, 4], each polygon's lowest x, y and highest x, y; NaN for a box row."""
        return self._extents[int(self.starts[i]):int(self.starts[i + 1])]

    @functools.cached_property
    def _extents(self) -> np.ndarray:
        """Every row's extent (:meth:`extents`), found at first use in two reductions over all the points."""
        out = np.full((len(self.boxes), 4), np.nan, np.float32)
        rows = np.flatnonzero(~self.boxes)
        if len(rows):       # the polygon rows' points lie back to back (a box row has none)
            at = self.bounds[rows]
            out[rows, :2] = np.minimum.reduceat(self.points, at, axis=0)
            out[rows, 2:] = np.maximum.reduceat(self.points, at, axis=0)
        out.setflags(write=False)
        return out

    def image(self, i: int) -> list[np.ndarray | None]:
        """Image i's rows: each polygon float32 [K, 2] (a view), or None for a box row."""
        return [None if self.boxes[r] else self.points[self.bounds[r]:self.bounds[r + 1]]
                for r in range(self.starts[i], self.starts[i + 1])]

    def take(self, rows: Sequence[np.ndarray]) -> Segments:
        """The segments of new images made of these rows (per new image, int indices of rows here)."""
        rows = [np.asarray(r, np.int64).reshape(-1) for r in rows]
        flat = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        lo, hi = self.bounds[flat], self.bounds[flat + 1]
        sizes = hi - lo
        picked = np.concatenate([np.arange(a, b) for a, b in zip(lo.tolist(), hi.tolist(), strict=True)]) \
            if len(flat) else np.zeros(0, np.int64)
        return Segments(starts=np.r_[0, np.cumsum([len(r) for r in rows], dtype=np.int64)].astype(np.int64),
                        bounds=np.r_[0, np.cumsum(sizes)].astype(np.int64), boxes=self.boxes[flat],
                        points=self.points[picked.astype(np.int64)])

    def images(self, first: int, last: int) -> Segments:
        """The segments of images ``first:last`` (a shard's chunk of the split)."""
        return self.take([np.arange(self.starts[i], self.starts[i + 1]) for i in range(first, last)])

    @classmethod
    def concat(cls, parts: Sequence[Segments]) -> Segments:
        """The images of ``parts`` one after another (a split's chunks joined)."""
        starts, bounds, rows, points = [np.zeros(1, np.int64)], [np.zeros(1, np.int64)], 0, 0
        for part in parts:
            starts.append(part.starts[1:] + rows)
            bounds.append(part.bounds[1:] + points)
            rows, points = rows + len(part.boxes), points + len(part.points)
        return cls(starts=np.concatenate(starts), bounds=np.concatenate(bounds),
                   boxes=np.concatenate([p.boxes for p in parts]).astype(bool) if parts else np.zeros(0, bool),
                   points=np.concatenate([p.points for p in parts]).reshape(-1, 2).astype(np.float32)
                   if parts else np.zeros((0, 2), np.float32))

    def arrays(self) -> dict[str, np.ndarray]:
        """What the label cache stores (:meth:`from_arrays` reads it back)."""
        return {"segment_starts": self.starts, "segment_bounds": self.bounds, "segment_boxes": self.boxes,
                "segment_points": self.points}

    @classmethod
    def from_arrays(cls, z) -> Segments | None:
        """From :meth:`arrays`' keys of ``z`` (a mapping, an ``np.load``); None when they are not there."""
        if "segment_bounds" not in getattr(z, "files", z):
            return None
        return cls(starts=z["segment_starts"].astype(np.int64), bounds=z["segment_bounds"].astype(np.int64),
                   boxes=z["segment_boxes"].astype(bool), points=z["segment_points"].astype(np.float32))


def split_segments(images: Sequence[Sequence[np.ndarray | None] | None], counts: Sequence[int]) -> Segments | None:
    """A split's :class:`Segments` from each image's rows' polygons (None for an image without a label file, whose
    ``counts`` rows are then box rows); None when no row has a polygon (a detection set)."""
    if not any(p is not None for rows in images if rows for p in rows):
        return None
    return Segments.from_images([rows if rows is not None else [None] * n
                                 for rows, n in zip(images, counts, strict=True)])
