"""The loader's half of the device augmentation: every random number and every label, no pixels.

With ``build_dataloader(..., augment_on="device")`` an augmenting dataset's items carry a recipe
instead of an image. `train_recipe` follows `DetectionDataset._train_sample` step by step: the
same generator calls in the same order (Mosaic coin, partners from the same recent-image buffer,
Mosaic centre, affine draw, MixUp coin, partner and Beta ratio, HSV gains, flip coins), and the
labels through the same functions (`mosaic4_canvas`, `affine_plan` / `affine_boxes`, `scale_boxes`),
so boxes and classes are the workers path's bit for bit. Only the pixels are left: a JPEG file's
bytes (decoded on the device), or the decoded, resized image where the workers already hold one
(RAM / disk cache) or the file is not a JPEG. `collate_recipes` packs a batch of recipes into a
few tensors that `yolokit.data.augment.device_augment.augment_batch` turns into the images.

A recipe's image is one or two *views* (the second: the MixUp partner), each an input frame
(the Mosaic's 2*imgsz canvas, or the letterboxed shape) holding up to four tiles (a source image
placed at a rectangle, the Mosaic's quadrants split at its centre), and the map from the frame to
the output: the inverse of the matrix the workers warp with (or of the one their paste realises,
with the input window it reads and the output window it writes).
"""

from __future__ import annotations

import numpy as np
import torch

from yolokit.data.augment.mosaic import mosaic4_canvas
from yolokit.data.augment.transforms import affine_boxes, affine_plan, hsv_lut, scale_boxes
from yolokit.data.buffers import SLOT_KEY, BatchBuffers, fresh_shared
from yolokit.ops.geometry import letterbox_plan

RECIPE_KEY = "recipe"
_FAR = 1 << 30       # a centre no pixel reaches: one quadrant, one tile
_WIDE = 1e9          # a window that clamps nothing


class Source:
    """A source image without its pixels yet: `shape` (h, w, 3) as loaded (long side imgsz), and
    `jpeg` (the file's bytes, uint8, and its `path`) or `pixels` (decoded, resized BGR [h, w, 3])."""

    def __init__(self, index: int, shape: tuple[int, int], jpeg: np.ndarray | None = None,
                 pixels: np.ndarray | None = None, decoded: tuple[int, int] | None = None, path: str = "") -> None:
        self.index, self.shape, self.path = index, (int(shape[0]), int(shape[1]), 3), path
        self.jpeg, self.pixels = jpeg, pixels
        self.decoded = decoded or (pixels.shape[:2] if pixels is not None else self.shape[:2])   # before resizing


def _loaded_size(ds, i: int) -> tuple[int, int]:
    h0, w0 = (int(v) for v in ds.index.shapes[i])
    r = ds.imgsz / max(h0, w0)
    return (h0, w0) if r == 1 else (max(1, round(h0 * r)), max(1, round(w0 * r)))


def _read_source(ds, i: int) -> Source:
    path = ds.index.paths[i]
    data = ds.index.image_bytes(i)
    if data.size > 3 and data[0] == 0xFF and data[1] == 0xD8 and _ends(data) and not _turned(data):
        return Source(i, _loaded_size(ds, i), jpeg=data, decoded=tuple(int(v) for v in ds.index.shapes[i]),
                      path=path)                                  # the device decodes it
    image = ds._read_resized(i)             # other formats, and JPEGs cut short since indexing: decoded here,
    return Source(i, image.shape[:2], pixels=image)   # or ImageError (another image is used, as the workers do)


def _ends(jpeg: np.ndarray) -> bool:
    """Whether a JPEG ends with its end-of-image marker (trailing zero padding allowed): a file cut
    short (written or copied while training) fails the device's whole decode call, so the workers
    decode it instead, as they would any file, and another image is used if they cannot."""
    tail = jpeg[-64:]
    last = np.flatnonzero(tail)
    return len(last) > 0 and last[-1] > 0 and tail[last[-1]] == 0xD9 and tail[last[-1] - 1] == 0xFF


def _has_exif(jpeg: np.ndarray) -> bool:
    """Whether a JPEG has an EXIF (APP1 "Exif") segment among its header segments, before the image data."""
    at, n = 2, min(jpeg.size, 1 << 20)
    while at + 10 <= n and jpeg[at] == 0xFF:
        marker = int(jpeg[at + 1])
        if marker == 0xE1 and jpeg[at + 4:at + 8].tobytes() == b"Exif":
            return True
        if marker == 0xDA or marker == 0xD9:          # start of scan, end of image: no more headers
            return False
        at += 2 + (int(jpeg[at + 2]) << 8 | int(jpeg[at + 3]))
    return at + 10 > n                                # cut short or not segment by segment: Pillow decides


def _turned(jpeg: np.ndarray) -> bool:
    """Whether a JPEG's EXIF orientation turns it (nvJPEG ignores the tag: such files are decoded here)."""
    if not _has_exif(jpeg):
        return False
    import io

    from PIL import Image
    try:
        with Image.open(io.BytesIO(jpeg.tobytes())) as im:
            return im.getexif().get(0x0112, 1) != 1
    except Exception:  # Pillow signals bad data many ways: the workers' decoder decides
        return True


def load_source(ds, i: int):
    """`DetectionDataset.load` without the decode: the same caches, the same recent-image buffer
    (so Mosaic partners are drawn from the same keys), the same labels."""
    if ds._ram is not None or ds._disk is not None:
        image = ds._ram.get(i) if ds._ram is not None else ds._disk.get(i, ds._read_resized)
        image = ds._read_resized(i) if image is None else image
        src = Source(i, image.shape[:2], pixels=image)
    elif i in ds._buffer:
        src = ds._buffer[i]
    else:
        src = ds._remember(i, _read_source(ds, i))
    h0, w0 = (int(v) for v in ds.index.shapes[i])
    h, w = src.shape[:2]
    if abs(h / w - h0 / w0) > 0.02 * h0 / w0:
        ds._warn_shape(i, (h0, w0), (h, w))
    ratio = (w / w0, h / h0)
    labels = ds.index.labels[i]
    return src, scale_boxes(labels[:, 1:5], ratio, (0, 0)), labels[:, 0].astype(np.int64), ratio


def load_any(ds, i: int):
    """`DetectionDataset._load_any` with `load_source`: (Source, boxes, classes, ratio, the index used)."""
    return ds._load_any(i, lambda j: load_source(ds, j))


class Letterboxed:
    """A source letterboxed into ``shape`` (h, w), without its pixels: the frame of a view that is not a
    Mosaic. ``shape`` (H, W, 3) and ``tiles`` (one: the source, placed as a Mosaic canvas places its
    tiles) as a `MosaicCanvas` has them; ``ratio_pad`` the letterbox's."""

    centre = (_FAR, _FAR)                 # one quadrant: the one tile

    def __init__(self, src: Source, shape: tuple[int, int]) -> None:
        lb = letterbox_plan(src.shape[:2], shape)
        if lb.size != src.shape[:2]:      # the letterbox resizes too: the device resizes the source once
            src = Source(src.index, lb.size, src.jpeg, src.pixels, src.decoded)
        left, top = lb.pad[:2]
        self.shape, self.ratio_pad = (*lb.shape, 3), lb.ratio_pad
        self.tiles = [(src, left, top, left + lb.size[1], top + lb.size[0], 0, 0)]


def frame_view(frame, plan) -> dict:
    """A recipe view: ``frame`` (a Mosaic canvas of Sources, or `Letterboxed`) warped by the affine ``plan``."""
    tiles = [tuple(t) for t in frame.tiles]
    centre = getattr(frame, "centre", None) or (tiles[0][3], tiles[0][4])   # a Mosaic's: where tile 0 ends
    return dict(frame=frame.shape[:2], centre=centre, tiles=tiles, plan=plan)


def _view(ds, i: int, rng: np.random.Generator):
    """`DetectionDataset._geometric_view` as a recipe: (view dict, boxes, classes, ratio_pad, i)."""
    hyp, s = ds.hyp, ds.imgsz
    affine = dict(degrees=hyp.degrees, translate=hyp.translate, scale=hyp.scale,
                  shear=hyp.shear, perspective=hyp.perspective)
    if not ds.rect and ds.mosaic and hyp.mosaic > 0 and rng.random() < hyp.mosaic:
        src, boxes, classes, ratio, i = load_any(ds, i)
        samples = [(src, boxes, classes)]
        for j in ds._partners(rng, i):
            samples.append(load_any(ds, j)[:3])
        canvas, boxes, classes = mosaic4_canvas(samples, s, rng)
        plan = affine_plan(rng, canvas.shape[:2], (s, s), **affine)
        boxes, classes = affine_boxes(plan, boxes, classes)
        return frame_view(canvas, plan), boxes, classes, (ratio, (0.0, 0.0)), i
    shape = ds.rect_shape(i) if ds.rect else (s, s)
    src, boxes, classes, ratio, i = load_any(ds, i)
    frame = Letterboxed(src, shape)
    r2, pad = frame.ratio_pad
    boxes = scale_boxes(boxes, r2, pad)
    plan = affine_plan(rng, frame.shape[:2], frame.shape[:2], **affine)
    boxes, classes = affine_boxes(plan, boxes, classes)
    return frame_view(frame, plan), boxes, classes, ((ratio[0] * r2[0], ratio[1] * r2[1]), pad), i


def flip_boxes(boxes: np.ndarray, shape: tuple[int, int], *, lr: bool) -> np.ndarray:
    """``boxes`` [G, 4] mirrored in an image of ``shape`` (H, W): left-right (``lr``) or top-bottom."""
    out = boxes.copy()
    a, b, size = (0, 2, shape[1]) if lr else (1, 3, shape[0])
    out[:, a], out[:, b] = size - boxes[:, b], size - boxes[:, a]
    return out


def train_recipe(ds, i: int, rng: np.random.Generator) -> dict:
    """Item ``i`` of an augmenting dataset as a recipe: the item dict with ``recipe`` instead of ``image``."""
    hyp = ds.hyp
    view, boxes, classes, ratio_pad, i = _view(ds, i, rng)
    views, mix = [view], 1.0
    if hyp.mixup > 0 and not ds.rect and rng.random() < hyp.mixup:
        other = _view(ds, int(ds._anywhere(rng, i)), rng)
        mix = float(rng.beta(32.0, 32.0))
        views.append(other[0])
        boxes = np.concatenate([boxes, other[1]]).astype(np.float32)
        classes = np.concatenate([classes, other[2]]).astype(np.int64)
    lut = hsv_lut(rng, h=hyp.hsv_h, s=hyp.hsv_s, v=hyp.hsv_v, hue=hyp.hue_mode)
    shape = views[0]["plan"].out_shape
    flips = [False, False]
    if rng.random() < hyp.fliplr:
        boxes, flips[0] = flip_boxes(boxes, shape, lr=True), True
    if rng.random() < hyp.flipud:
        boxes, flips[1] = flip_boxes(boxes, shape, lr=False), True
    return recipe_item(ds, i, dict(views=views, mix=mix, lut=lut, flips=flips), boxes, classes, ratio_pad)


def recipe_item(ds, i: int, recipe: dict, boxes: np.ndarray, classes: np.ndarray, ratio_pad: tuple,
                **extra) -> dict:
    """Item ``i``'s dict for ``recipe`` (views, mix, lut, flips; its shape: the first view's output)."""
    recipe = dict(recipe, shape=tuple(recipe["views"][0]["plan"].out_shape))
    return {RECIPE_KEY: recipe, "boxes": torch.from_numpy(np.ascontiguousarray(boxes, np.float32).reshape(-1, 4)),
            "classes": torch.from_numpy(np.ascontiguousarray(classes, np.int64).reshape(-1)),
            "path": ds.index.paths[i], "orig_shape": tuple(int(v) for v in ds.index.shapes[i]),
            "ratio_pad": ratio_pad, "index": i, **extra}


def _view_rows(view: dict, source_id) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One view's rows: tiles int64 [4, 7], frame int64 [4], inverse float64 [3, 3], windows float64 [8]."""
    tiles = np.full((4, 7), -1, np.int64)
    for k, (src, x1, y1, x2, y2, sx, sy) in enumerate(view["tiles"]):
        tiles[k] = (source_id(src), x1, y1, x2, y2, sx, sy)
    plan = view["plan"]
    (fh, fw), (oh, ow) = view["frame"], plan.out_shape
    frame = np.array([fh, fw, *view["centre"]], np.int64)
    windows = np.array([-_WIDE, _WIDE, -_WIDE, _WIDE, 0, ow, 0, oh], np.float64)
    if plan.kind == "paste":             # reads input [a, b) x [c, d), writes output [x_lo, x_hi) x [y_lo, y_hi)
        (a, b, x_lo, x_hi), (c, d, y_lo, y_hi) = plan.spans
        windows[:] = (a, b - 1, c, d - 1, max(x_lo, 0), min(x_hi, ow), max(y_lo, 0), min(y_hi, oh))
    elif plan.kind == "empty":
        windows[4:] = 0
    return tiles, frame, np.linalg.inv(plan.box_m if plan.kind == "paste" else plan.m), windows


def collate_recipes(items: list[dict], buffers: BatchBuffers | None = None) -> dict:
    """A batch of recipe items: the batch contract's labels and metadata, and the recipe tensors.

    Keys besides ``targets``, ``paths``, ``orig_shapes``, ``ratio_pad``, ``indices``, ``max_boxes``:
        aug_jpeg      uint8 Tensor[total bytes], the JPEG files one after the other
        aug_files     list of their paths (for the device's message when one cannot be decoded)
        aug_pixels    uint8 Tensor[3, total pixels], the decoded sources, RGB planes, one after the other
        aug_sources   int64 array[S, 6]: (0 jpeg / 1 pixels, its bytes or pixels, decoded h, w, target h, w)
        aug_tiles     int64 array[B, 2, 4, 7]: per view, tile (source or -1, x1, y1, x2, y2, sx, sy)
        aug_frame     int64 array[B, 2, 4]: per view, the input frame's (h, w) and the Mosaic centre
        aug_inverse   float64 array[B, 2, 3, 3]: per view, output pixel centre -> input pixel centre
        aug_windows   float64 array[B, 2, 8]: per view, input clamp (x0, x1, y0, y1), output window
        aug_mix       float64 array[B]: weight of view 0 (1: no MixUp)
        aug_flip      bool array[B, 2]: left-right, top-bottom
        aug_shape     int64 array[B, 2]: each image's (h, w)
        hsv_lut       uint8 Tensor[B, 3, 256], when the HSV ranges are set

    The small recipe arrays stay numpy arrays: a worker pickles them with the batch, where a tensor
    each would cost a shared-memory segment each (0.6 ms of CPU an image for the batch's hand-over
    from the worker, against 0.1 ms so).
    """
    sources: dict[tuple, int] = {}
    rows_src, jpegs, pixels, files = [], [], [], []
    jpeg_at, pixel_at = 0, 0

    def source_id(src: Source) -> int:
        nonlocal jpeg_at, pixel_at
        key = (src.index, src.shape)
        if key not in sources:
            sources[key] = len(rows_src)
            if src.jpeg is not None:
                jpegs.append(src.jpeg)
                files.append(src.path)
                rows_src.append((0, jpeg_at, *src.decoded, *src.shape[:2]))
                jpeg_at += src.jpeg.size
            else:
                image = src.pixels
                rows_src.append((1, pixel_at, *image.shape[:2], *src.shape[:2]))
                pixels.append(np.ascontiguousarray(image[..., ::-1].transpose(2, 0, 1)).reshape(3, -1))
                pixel_at += image.shape[0] * image.shape[1]
        return sources[key]

    b = len(items)
    tiles = np.full((b, 2, 4, 7), -1, np.int64)
    frame = np.zeros((b, 2, 4), np.int64)
    inverse = np.tile(np.eye(3), (b, 2, 1, 1))
    windows = np.zeros((b, 2, 8), np.float64)
    luts, counts = [], []
    for n, it in enumerate(items):
        rec = it[RECIPE_KEY]
        for v, view in enumerate(rec["views"]):
            tiles[n, v], frame[n, v], inverse[n, v], windows[n, v] = _view_rows(view, source_id)
        luts.append(rec["lut"])
        counts.append(len(it["classes"]))
    targets = np.zeros((sum(counts), 6), np.float32)        # (image, class, x1, y1, x2, y2)
    if len(targets):
        targets[:, 0] = np.repeat(np.arange(b, dtype=np.float32), counts)
        targets[:, 1] = np.concatenate([it["classes"].numpy() for it in items])
        targets[:, 2:] = np.concatenate([it["boxes"].numpy().reshape(-1, 4) for it in items])
    slot = None
    if jpegs:                       # into a worker's reused shared buffer (data.buffers), as the images go
        jpeg, slot = (buffers.empty((jpeg_at,), torch.uint8) if buffers is not None
                      else (fresh_shared((jpeg_at,), torch.uint8), None))
        out, at = jpeg.numpy(), 0
        for data in jpegs:
            out[at:at + data.size] = data
            at += data.size
    else:
        jpeg = torch.zeros(0, dtype=torch.uint8)
    recs = [it[RECIPE_KEY] for it in items]
    batch = {
        "targets": torch.from_numpy(targets),
        "paths": [it["path"] for it in items],
        "orig_shapes": [tuple(it["orig_shape"]) for it in items],
        "ratio_pad": [it["ratio_pad"] for it in items],
        "indices": [int(it["index"]) for it in items],
        "max_boxes": max((len(it["classes"]) for it in items), default=0),
        "aug_jpeg": jpeg,
        "aug_files": files,
        "aug_pixels": torch.from_numpy(np.concatenate(pixels, 1)) if pixels else torch.zeros((3, 0), dtype=torch.uint8),
        "aug_sources": np.array(rows_src, dtype=np.int64).reshape(-1, 6),
        "aug_tiles": tiles, "aug_frame": frame, "aug_inverse": inverse, "aug_windows": windows,
        "aug_mix": np.array([r["mix"] for r in recs], dtype=np.float64),
        "aug_flip": np.array([r["flips"] for r in recs], dtype=bool).reshape(b, 2),
        "aug_shape": np.array([r["shape"] for r in recs], dtype=np.int64).reshape(b, 2),
    }
    if any(lut is not None for lut in luts):
        batch["hsv_lut"] = torch.from_numpy(np.stack(luts))
    if slot is not None:
        batch[SLOT_KEY] = slot                       # the loader takes it out (BatchBuffers.received)
    return batch
