"""Mosaic of four (or nine) images and MixUp of two, on (image, boxes, classes) samples.

Both work on samples from any source: a sample is a tuple `(image [h, w, 3] uint8,
boxes [G, 4] float32 xyxy pixels, classes [G])`. The Dataset loads the samples and
follows a Mosaic with `random_affine` back to the training size.
"""

from __future__ import annotations

import cv2
import numpy as np

from yolokit.data.sources.images import PAD_VALUE

Sample = tuple[np.ndarray, np.ndarray, np.ndarray]


def mosaic4(samples: list[Sample], size: int, rng: np.random.Generator, *,
            pad_value: int = PAD_VALUE) -> Sample:
    """Tile four samples around a random centre of a `2*size` square canvas.

    Sample k goes to the top-left, top-right, bottom-left, bottom-right of the
    centre, which is drawn uniformly in `[size/2, 3*size/2)` on each axis. Each
    image is cut where it leaves its quarter, and its boxes are clipped to the part
    that is shown (never to a neighbour's part).

    Args:
        samples: four samples, images no larger than `size` on either side.
        size: the training size; the canvas is `2*size` square.
        rng: source of randomness.
        pad_value: fill where no image lands.

    Returns:
        canvas [2*size, 2*size, 3], boxes [G, 4] in canvas pixels, classes [G].
    """
    canvas, boxes, classes = mosaic4_canvas(samples, size, rng, pad_value=pad_value)
    return np.asarray(canvas), boxes, classes


class MosaicCanvas:
    """A Mosaic canvas that paints only the regions that are read from it.

    Indexing with two slices (``canvas[y0:y1, x0:x1]``) returns that region as a new
    uint8 array, equal to the same region of the painted canvas; ``np.asarray`` paints
    it all. ``random_affine`` reads only the part of its input that lands in its output,
    so after a zoom-in most of the canvas is never painted.
    """

    def __init__(self, side: int, tiles: list[tuple[np.ndarray, int, int, int, int, int, int]], pad_value: int):
        self.shape = (side, side, 3)
        self.dtype = np.dtype(np.uint8)
        self.ndim = 3
        self._tiles, self._pad = tiles, pad_value

    @property
    def tiles(self) -> list[tuple[np.ndarray, int, int, int, int, int, int]]:
        """Each sample's ``(image, x1, y1, x2, y2, sx, sy)``: shown at ``[y1:y2, x1:x2]`` from its ``(sx, sy)``."""
        return self._tiles

    def __getitem__(self, key: tuple[slice, slice]) -> np.ndarray:
        rows, cols = key
        y0, y1, _ = rows.indices(self.shape[0])
        x0, x1, _ = cols.indices(self.shape[1])
        y1, x1 = max(y1, y0), max(x1, x0)
        out = np.empty((y1 - y0, x1 - x0, 3), np.uint8)    # each pixel written once: a tile's, or grey
        xc, yc = self._tiles[0][3], self._tiles[0][4]    # the centre: tile 0 ends there
        for k, (_, x1t, y1t, x2t, y2t, _, _) in enumerate(self._tiles):   # tile k: the centre's corner of quadrant k
            qx0, qx1 = (x0, min(x1, xc)) if k in (0, 2) else (max(x0, xc), x1)
            qy0, qy1 = (y0, min(y1, yc)) if k in (0, 1) else (max(y0, yc), y1)
            if qx0 >= qx1 or qy0 >= qy1:
                continue
            tx0, tx1 = min(max(x1t, qx0), qx1), max(min(x2t, qx1), qx0)   # the tile's part of it
            ty0, ty1 = min(max(y1t, qy0), qy1), max(min(y2t, qy1), qy0)
            if tx0 >= tx1 or ty0 >= ty1:
                tx0 = tx1 = qx0
                ty0 = ty1 = qy0
            for r0, r1, c0, c1 in ((qy0, ty0, qx0, qx1), (ty1, qy1, qx0, qx1),    # grey around it
                                   (ty0, ty1, qx0, tx0), (ty0, ty1, tx1, qx1)):
                if r0 < r1 and c0 < c1:
                    out[r0 - y0:r1 - y0, c0 - x0:c1 - x0] = self._pad
        for image, x1t, y1t, x2t, y2t, sx, sy in self._tiles:  # tile placed at [y1t:y2t, x1t:x2t]
            a, b = max(x0, x1t), min(x1, x2t)
            c, d = max(y0, y1t), min(y1, y2t)
            if a < b and c < d:
                out[c - y0:d - y0, a - x0:b - x0] = image[sy + c - y1t:sy + d - y1t, sx + a - x1t:sx + b - x1t]
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        full = self[0:self.shape[0], 0:self.shape[1]]
        return full if dtype is None else full.astype(dtype)


def mosaic4_canvas(samples: list[Sample], size: int, rng: np.random.Generator, *,
                   pad_value: int = PAD_VALUE) -> tuple[MosaicCanvas, np.ndarray, np.ndarray]:
    """``mosaic4`` with the canvas as a ``MosaicCanvas``, painted only where it is read.

    Draws the same centre from ``rng`` and returns the same boxes and classes as
    ``mosaic4``; ``np.asarray`` of the canvas is ``mosaic4``'s canvas.
    """
    canvas, boxes, classes, _ = mosaic4_rows(samples, size, rng, pad_value=pad_value)
    return canvas, boxes, classes


def mosaic4_polygons(polygons: list[np.ndarray], canvas: MosaicCanvas, kept: list[np.ndarray]) -> np.ndarray:
    """The samples' polygons (float32 [G_k, K, 2] each, in their images' pixels) placed as ``mosaic4_rows`` placed
    their boxes: shifted with their tile, clipped to the part of the canvas the tile shows, the kept rows only.

    Returns:
        float32 [G, K, 2], rows in the order of the Mosaic's boxes.
    """
    rows = [np.take(np.asarray(p, np.float32), k, 0) for p, k in zip(polygons, kept, strict=True)]
    return place_in_tiles(np.concatenate(rows), canvas, [len(k) for k in kept])


def place_in_tiles(polygons: np.ndarray, canvas: MosaicCanvas, counts: list[int]) -> np.ndarray:
    """:func:`mosaic4_polygons` of rows already taken: float32 [G, K, 2], ``counts[t]`` rows of tile t one tile
    after another, placed in place (all tiles in one pass)."""
    frame = np.repeat(np.array([(x1 - sx, y1 - sy, x1, y1, x2, y2) for _, x1, y1, x2, y2, sx, sy in canvas.tiles],
                               np.float32).reshape(-1, 6), counts, 0)
    # operands of the polygons' own shape: NumPy broadcasts a last axis of 2 far slower
    frame = np.ascontiguousarray(frame.reshape(-1, 1, 3, 2).transpose(2, 0, 1, 3))      # [3, G, 1, 2]
    shift, low, high = frame.repeat(polygons.shape[1], 2)
    polygons += shift
    np.maximum(polygons, low, out=polygons)
    return np.minimum(polygons, high, out=polygons)


def mosaic4_rows(samples: list[Sample], size: int, rng: np.random.Generator, *,
                 pad_value: int = PAD_VALUE) -> tuple[MosaicCanvas, np.ndarray, np.ndarray, list[np.ndarray]]:
    """``mosaic4_canvas``, and which rows of each sample it kept (int64 indices per sample, in order): what
    goes with the rows (polygons: ``mosaic4_polygons``) follows them."""
    if len(samples) != 4:
        raise ValueError(f"mosaic4 needs 4 samples, got {len(samples)}")
    s2 = 2 * size
    xc, yc = (int(v) for v in rng.integers(size // 2, size + size // 2, 2))
    tiles, all_boxes, all_classes, kept = [], [], [], []
    for k, (image, boxes, classes) in enumerate(samples):
        h, w = image.shape[:2]
        x1, x2 = (max(xc - w, 0), xc) if k in (0, 2) else (xc, min(xc + w, s2))
        y1, y2 = (max(yc - h, 0), yc) if k in (0, 1) else (yc, min(yc + h, s2))
        sx = w - (x2 - x1) if k in (0, 2) else 0  # source offset of the shown part
        sy = h - (y2 - y1) if k in (0, 1) else 0
        tiles.append((image, x1, y1, x2, y2, sx, sy))
        if len(boxes):
            b = boxes + np.array([x1 - sx, y1 - sy, x1 - sx, y1 - sy], np.float32)
            b[:, [0, 2]] = b[:, [0, 2]].clip(x1, x2)
            b[:, [1, 3]] = b[:, [1, 3]].clip(y1, y2)
            keep = (b[:, 2] > b[:, 0]) & (b[:, 3] > b[:, 1])
            all_boxes.append(b[keep])
            all_classes.append(np.asarray(classes)[keep])
            kept.append(np.flatnonzero(keep))
        else:
            kept.append(np.zeros(0, np.int64))
    boxes = np.concatenate(all_boxes) if all_boxes else np.zeros((0, 4), np.float32)
    classes = np.concatenate(all_classes) if all_classes else np.zeros(0, np.int64)
    return MosaicCanvas(s2, tiles, pad_value), boxes.astype(np.float32), classes.astype(np.int64), kept


def mosaic_canvas(samples: list[Sample], size: int, rng: np.random.Generator, *, tiles: int = 4,
                  pad_value: int = PAD_VALUE) -> tuple[MosaicCanvas, np.ndarray, np.ndarray]:
    """The canvas, boxes and classes of a Mosaic of ``tiles`` (4: ``mosaic4_canvas``, 9: ``mosaic9_rows``)."""
    if tiles == 9:
        return mosaic9_rows(samples, size, pad_value=pad_value)[:3]
    return mosaic4_canvas(samples, size, rng, pad_value=pad_value)   # painted where the affine reads


class PaintedMosaic(MosaicCanvas):
    """A Mosaic canvas painted whole (a 9-image Mosaic, whose tiles may overlap): indexing and ``np.asarray``
    give read-only views of the painted array (copy before writing); ``tiles`` say where each sample's rows
    went, as ``MosaicCanvas.tiles`` do."""

    def __init__(self, painted: np.ndarray, tiles: list[tuple[np.ndarray, int, int, int, int, int, int]],
                 pad_value: int):
        super().__init__(painted.shape[0], tiles, pad_value)
        self._painted = painted
        painted.setflags(write=False)

    def __getitem__(self, key: tuple[slice, slice]) -> np.ndarray:
        return self._painted[key]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return self._painted if dtype is None else self._painted.astype(dtype)


def mosaic9_rows(samples: list[Sample], size: int, *, pad_value: int = PAD_VALUE
                 ) -> tuple[PaintedMosaic, np.ndarray, np.ndarray, list[np.ndarray]]:
    """Nine samples laid out as the reference's 9-image Mosaic, on a ``2 * size`` canvas, and which rows of each
    sample it kept (as ``mosaic4_rows``).

    Sample 0 is placed at ``(size, size)`` of a ``3 * size`` square; the others go around it clockwise from the
    top (top, top right, right, bottom right, bottom, bottom left, left, top left), each against the centre
    image's sides and the previous sample's size, later ones painted over earlier ones where they meet. The
    canvas is the middle ``2 * size`` square of that (``size / 2`` cut from each side). Each sample's boxes are
    shifted with it and clipped to the canvas (not to its visible part: a box under a later tile stays, as the
    reference keeps it); boxes of no area are dropped. Draws nothing from a generator: the layout is fixed.

    Returns:
        canvas (``PaintedMosaic``; its ``tiles`` give each sample's shift, clipped to the canvas), boxes [G, 4]
        in canvas pixels, classes [G], and the int64 indices of each sample's rows kept.
    """
    if len(samples) != 9:
        raise ValueError(f"mosaic9 needs 9 samples, got {len(samples)}")
    s, cut = size, -(-size // 2)                                     # the reference's border: ceil(size / 2)
    side = 3 * s - 2 * cut
    painted = np.full((3 * s, 3 * s, 3), pad_value, np.uint8)
    tiles, all_boxes, all_classes, kept = [], [], [], []
    hp = wp = h0 = w0 = 0
    for k, (image, boxes, classes) in enumerate(samples):
        h, w = image.shape[:2]
        if k == 0:
            h0, w0 = h, w
        x, y = ((s, s), (s, s - h), (s + wp, s - h), (s + w0, s), (s + w0, s + hp), (s + w0 - w, s + h0),
                (s + w0 - wp - w, s + h0), (s - w, s + h0 - h), (s - w, s + h0 - hp - h))[k]
        x1, y1, x2, y2 = max(x, 0), max(y, 0), max(x + w, 0), max(y + h, 0)
        painted[y1:y2, x1:x2] = image[y1 - y:y2 - y, x1 - x:x2 - x]
        dx, dy = x - cut, y - cut                                   # the sample's shift into the canvas
        tiles.append((image, 0, 0, side, side, -dx, -dy))
        b = np.asarray(boxes, np.float32).reshape(-1, 4) + np.array([dx, dy, dx, dy], np.float32)
        b = b.clip(0, side)
        keep = (b[:, 2] > b[:, 0]) & (b[:, 3] > b[:, 1])
        all_boxes.append(b[keep])
        all_classes.append(np.asarray(classes, np.int64).reshape(-1)[keep])
        kept.append(np.flatnonzero(keep))
        hp, wp = h, w
    canvas = PaintedMosaic(np.ascontiguousarray(painted[cut:cut + side, cut:cut + side]), tiles, pad_value)
    return canvas, np.concatenate(all_boxes).astype(np.float32), np.concatenate(all_classes).astype(np.int64), kept


def mixup(a: Sample, b: Sample, rng: np.random.Generator) -> Sample:
    """Blend two same-size samples with a Beta(32, 32) weight and keep both box sets.

    Args:
        a, b: samples whose images have the same shape.
        rng: source of randomness.

    Returns:
        the blended image and the concatenated boxes [Ga + Gb, 4] and classes.
    """
    r = float(rng.beta(32.0, 32.0))
    image = cv2.addWeighted(a[0], r, b[0], 1.0 - r, 0.0)
    return (image, np.concatenate([a[1], b[1]]).astype(np.float32),
            np.concatenate([a[2], b[2]]).astype(np.int64))
