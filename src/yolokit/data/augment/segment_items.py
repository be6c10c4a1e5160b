"""A segmentation set's items (``DetectionDataset(segments=True)``): the detection item's steps and draws, each
moving the rows' polygons too (``polygons``), and the masks drawn from them at the end.

Mosaic shifts each tile's polygons with it and clips them to the part of the canvas the tile shows (a
9-image Mosaic: to the canvas, as it clips the boxes); the
affine step warps them (``transforms.affine_polygons``: a warped polygon's visible part gives its row's box,
and rows keep a hundredth of their area at least, the reference's threshold with polygons); letterbox,
flips and MixUp move or join them as they do the boxes. Copy-paste (``AugmentConfig.copy_paste``, 0 by
default as the reference's) pastes the image's objects mirrored onto it after Mosaic, before the warp.
The random draws are the detection item's, in its order (and, with copy-paste on, one more before each
warp), so without copy-paste an image is augmented the same way whether its set is read for boxes or masks.

An item's ``masks`` are at 1/``mask_ratio`` of its image: with ``overlap_mask`` one index map uint8
[H/r, W/r] (int32 past 255 rows), 0 for background and k + 1 where row k is, the rows put in the map's
order (larger objects first, a smaller one drawn over a larger: ``polygons.overlap_mask``); without it
uint8 [G, H/r, W/r], one per row. ``mask_rows`` (bool [G]) is False for a box row of a mixed set: a row
without a polygon keeps its box and class, and its mask has no pixel.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import numpy as np
import torch

from yolokit.data.augment.mosaic import mixup, mosaic4_rows, mosaic9_rows, place_in_tiles
from yolokit.data.augment.polygons import (
    POINTS,
    box_outlines,
    copy_paste,
    flip_polygons,
    instance_masks,
    place_rows,
    resampled_rows,
    scale_polygons,
)
from yolokit.data.augment.recipes import RECIPE_KEY, Letterboxed, flip_boxes, frame_view, load_any, recipe_item
from yolokit.data.augment.transforms import (
    affine_plan,
    affine_polygons,
    apply_hsv_lut,
    flip_lr,
    flip_ud,
    hsv_lut,
    scale_boxes,
    warp_image,
)
from yolokit.data.sources.images import letterbox
from yolokit.data.sources.readers import DatasetError

logger = logging.getLogger("yolokit.data")
_NO_ROWS = np.zeros(0, np.int64)
OUTLINE_CACHE_BYTES = 64 << 20   # resampled outlines a process keeps (8 KB a row: 8,192 rows)


def check_segments(ds: Any, where: str, albumentations: Any) -> None:
    """Refuses in one line what cannot make masks (a split without polygons, albumentations, a bad ratio); for a
    set read for boxes, says once that copy-paste, which needs outlines, is off."""
    if not ds.segments:
        if ds.augment and ds.hyp.copy_paste > 0:
            logger.warning("%s: copy_paste %g is off: it pastes objects by their outlines, and this set is read "
                           "for boxes (segments=False)", where, ds.hyp.copy_paste)
        return
    index, mask_ratio = ds.index, ds.mask_ratio
    if index.segments is None:
        raise DatasetError(f"{where}: no label row has a polygon, so there are no masks to learn; segmentation "
                           "needs rows 'class x1 y1 x2 y2 x3 y3 ...' (a detection set trains a detection model)")
    if albumentations is not None:
        raise ValueError("albumentations cannot be used with segments yet: its transforms would move the image "
                         "and boxes but not the polygons")
    if int(mask_ratio) < 1:
        raise ValueError(f"mask_ratio must be a positive integer, got {mask_ratio!r}")


def read_masks(ds: Any, where: str, *, mask_ratio: int = 4, overlap: bool = True) -> None:
    """Makes a built set's items carry masks, as ``DetectionDataset(segments=True, ...)`` would have: what a
    trainer does once it knows its model segments (the set was scanned before the model was built). The same
    refusals as at construction, naming ``where``. Call it before the loader's workers start."""
    ds.segments, ds.mask_ratio, ds.overlap_mask = True, int(mask_ratio), bool(overlap)
    check_segments(ds, where, ds.albumentations)


def _polygons(ds: Any, i: int, boxes: np.ndarray, ratio: tuple[float, float]):
    """Image i's rows' polygons by ``load``'s ``ratio`` and ``boxes`` (``polygons.row_polygons``)."""
    resampled, has, _ = _resampled(ds, i, None)
    return place_rows(resampled, has, boxes, ratio)


def _resampled(ds: Any, i: int, rows: np.ndarray | None = _NO_ROWS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Image i's rows resampled (``polygons.resampled_rows``), which have a polygon (bool [G]), and their extents
    (``Segments.extents``, float64 [G, 4], NaN for a box row).

    Each row is resampled when first needed (``rows``, its indices; None: all; rows not yet needed are zeros) and
    kept: an outline is resampled once for all the items and epochs it is in, and not at all while no warp shows
    it. The process keeps ``OUTLINE_CACHE_BYTES`` of outlines at most; past that the oldest go first, those of the
    dataset's buffer of recent images (a Mosaic's partners) last.
    """
    cache = ds.__dict__.setdefault("_resampled_rows", {})
    entry = cache.get(i)
    if entry is None:
        extents = ds.index.segments.extents(i).astype(np.float64)
        has = ~np.isnan(extents[:, 0])
        entry = cache[i] = [np.zeros((len(has), POINTS, 2), np.float32), has, extents, ~has, int(has.sum())]
        has.setflags(write=False)                        # shared by later items
        extents.setflags(write=False)
        ds._resampled_bytes = getattr(ds, "_resampled_bytes", 0) + entry[0].nbytes
        if ds._resampled_bytes > OUTLINE_CACHE_BYTES:
            _evict(ds, cache, i)
    resampled, has, extents, done, left = entry
    if not left or (rows is not None and not len(rows)):     # left: the rows with a polygon not yet resampled
        return resampled, has, extents
    need = np.flatnonzero(~done) if rows is None else rows[~done[rows]]
    if len(need):
        polygons = ds.index.segments.image(i)
        resampled[need] = resampled_rows([polygons[k] for k in need])[0]
        done[need] = True
        entry[4] = left - len(need)
    return resampled, has, extents


def _evict(ds: Any, cache: dict, keep: int) -> None:
    """Drops the oldest outlines until the cache is within its bytes: first those of images out of the buffer,
    then the buffer's (never image ``keep``'s)."""
    for spare_buffer in (True, False):
        victims, freed = [], 0
        for k, entry in cache.items():                   # oldest first; stops once enough is found
            if ds._resampled_bytes - freed <= OUTLINE_CACHE_BYTES:
                break
            if k != keep and not (spare_buffer and k in ds._buffer):
                victims.append(k)
                freed += entry[0].nbytes
        for k in victims:
            del cache[k]
        ds._resampled_bytes -= freed
        if ds._resampled_bytes <= OUTLINE_CACHE_BYTES:
            return


def segment_item(ds: Any, i: int, rng: np.random.Generator) -> dict:
    """``__getitem__`` with polygons: the detection item's steps and draws, each moving the rows' polygons too;
    the masks drawn from them at the end. With ``augment_on="device"`` (``recipe_in_batch``) a recipe item
    (``recipes.train_recipe``'s) with the masks: the labels here, the pixels on the device."""
    lut = None
    if ds.augment and ds.recipe_in_batch:
        return _recipe_item(ds, i, rng)
    if ds.augment:
        image, boxes, classes, polys, has, ratio_pad, i, lut = _train_sample(ds, i, rng)
    else:
        image, boxes, classes, ratio, i = ds._load_any(i)
        polys, has = _polygons(ds, i, boxes, ratio)
        image, (r2, pad) = letterbox(image, ds.imgsz, stride=ds.stride, auto=ds.rect)
        boxes, polys = scale_boxes(boxes, r2, pad), scale_polygons(polys, r2, pad)
        ratio_pad = ((ratio[0] * r2[0], ratio[1] * r2[1]), pad)
    masks, order = instance_masks(polys, has, image.shape[:2], ds.mask_ratio, overlap=ds.overlap_mask)
    return ds.item(image, np.asarray(boxes, np.float32).reshape(-1, 4)[order],
                   np.asarray(classes, np.int64).reshape(-1)[order], ratio_pad, i, lut, **_mask_keys(masks, has, order))


def _mask_keys(masks: np.ndarray, has: np.ndarray, order: np.ndarray) -> dict:
    return dict(masks=torch.from_numpy(np.ascontiguousarray(masks)),
                mask_rows=torch.from_numpy(np.ascontiguousarray(has[order], bool)))


def _recipe_item(ds: Any, i: int, rng: np.random.Generator) -> dict:
    """`_train_sample`'s draws and labels with recipe views for pixels (``recipes``): the workers path's boxes,
    classes and masks bit for bit, the images made on the device."""
    hyp = ds.hyp
    view, boxes, classes, polys, has, ratio_pad, i = _view(ds, i, rng, recipe=True)
    views, mix = [view], 1.0
    if hyp.mixup > 0 and not ds.rect and rng.random() < hyp.mixup:
        other = _view(ds, int(ds._anywhere(rng, i)), rng, recipe=True)
        mix = float(rng.beta(32.0, 32.0))                 # mixup's draw
        views.append(other[0])
        boxes = np.concatenate([boxes, other[1]]).astype(np.float32)
        classes = np.concatenate([classes, other[2]]).astype(np.int64)
        polys, has = np.concatenate([polys, other[3]]), np.concatenate([has, other[4]])
    lut = hsv_lut(rng, h=hyp.hsv_h, s=hyp.hsv_s, v=hyp.hsv_v, hue=hyp.hue_mode)
    shape = view["plan"].out_shape
    flips = [False, False]
    for k, lr in enumerate((True, False)):                # random_flip's two draws
        if rng.random() < (hyp.fliplr if lr else hyp.flipud):
            boxes, polys, flips[k] = flip_boxes(boxes, shape, lr=lr), flip_polygons(polys, shape, lr=lr), True
    masks, order = instance_masks(polys, has, shape, ds.mask_ratio, overlap=ds.overlap_mask)
    return recipe_item(ds, i, dict(views=views, mix=mix, lut=lut, flips=flips),
                       np.asarray(boxes, np.float32).reshape(-1, 4)[order],
                       np.asarray(classes, np.int64).reshape(-1)[order], ratio_pad, **_mask_keys(masks, has, order))


def _train_sample(ds: Any, i: int, rng: np.random.Generator):
    hyp = ds.hyp
    image, boxes, classes, polys, has, ratio_pad, i = _view(ds, i, rng)
    if hyp.mixup > 0 and not ds.rect and rng.random() < hyp.mixup:
        other = _view(ds, int(ds._anywhere(rng, i)), rng)
        image, boxes, classes = mixup((image, boxes, classes), other[:3], rng)
        polys, has = np.concatenate([polys, other[3]]), np.concatenate([has, other[4]])
    lut = hsv_lut(rng, h=hyp.hsv_h, s=hyp.hsv_s, v=hyp.hsv_v, hue=hyp.hue_mode)
    if lut is not None and not ds.hsv_in_batch:
        image, lut = apply_hsv_lut(image, lut), None
    if rng.random() < hyp.fliplr:            # random_flip's two draws, the polygons mirrored with the image
        image, boxes = flip_lr(image, boxes)
        polys = flip_polygons(polys, image.shape[:2], lr=True)
    if rng.random() < hyp.flipud:
        image, boxes = flip_ud(image, boxes)
        polys = flip_polygons(polys, image.shape[:2], lr=False)
    return image, boxes, classes, polys, has, ratio_pad, i, lut


def _view(ds: Any, i: int, rng: np.random.Generator, recipe: bool = False):
    """``_geometric_view`` with the rows' polygons (the same draws): Mosaic + affine, or letterbox + affine.
    ``recipe``: the sources without pixels (``recipes.load_any``) and a recipe view for the image."""
    hyp, s = ds.hyp, ds.imgsz
    affine = dict(degrees=hyp.degrees, translate=hyp.translate, scale=hyp.scale,
                  shear=hyp.shear, perspective=hyp.perspective)
    load = (lambda j: load_any(ds, j)) if recipe else ds._load_any
    if not ds.rect and ds.mosaic and hyp.mosaic > 0 and rng.random() < hyp.mosaic:
        image, boxes, classes, ratio, i = load(i)
        samples, sources = [(image, boxes, classes)], [(i, boxes, ratio)]
        for j in ds._partners(rng, i):
            im, b, c, r, j = load(j)
            samples.append((im, b, c))
            sources.append((j, b, r))
        canvas, boxes, classes, kept = mosaic9_rows(samples, s) if hyp.mosaic_tiles == 9 else \
            mosaic4_rows(samples, s, rng)
        rows = [(j, b, r, k) for (j, b, r), k in zip(sources, kept, strict=True)]
        if hyp.copy_paste > 0 and rng.random() < hyp.copy_paste:      # on the whole canvas, as the reference's
            polygons, has, _ = _mosaic_polygons(ds, rows, canvas)
            canvas, boxes, classes, polygons, has = copy_paste(np.asarray(canvas), boxes, classes, polygons, has,
                                                               hyp.copy_paste)
            return (*_affine(canvas, boxes, classes, polygons, has, rng, (s, s), affine),
                    (ratio, (0.0, 0.0)), i)
        plan = affine_plan(rng, canvas.shape[:2], (s, s), **affine)
        polygons, has, shown = _mosaic_polygons(ds, rows, canvas, plan)   # only the rows the warp may show
        image, boxes, classes, polygons, has = _warp(canvas, boxes[shown], classes[shown], polygons, has, plan,
                                                     affine, recipe)
        return image, boxes, classes, polygons, has, (ratio, (0.0, 0.0)), i
    shape = ds.rect_shape(i) if ds.rect else (s, s)
    image, boxes, classes, ratio, i = load(i)
    polygons, has = _polygons(ds, i, boxes, ratio)
    if recipe:
        image = Letterboxed(image, shape)
        r2, pad = image.ratio_pad
    else:
        image, (r2, pad) = letterbox(image, shape)
    boxes, polygons = scale_boxes(boxes, r2, pad), scale_polygons(polygons, r2, pad)
    if hyp.copy_paste > 0 and rng.random() < hyp.copy_paste:
        image, boxes, classes, polygons, has = copy_paste(image, boxes, classes, polygons, has, hyp.copy_paste)
    image, boxes, classes, polygons, has = _affine(image, boxes, classes, polygons, has, rng, image.shape[:2],
                                                   affine, recipe)
    return image, boxes, classes, polygons, has, ((ratio[0] * r2[0], ratio[1] * r2[1]), pad), i


def _affine(image, boxes, classes, polygons, has, rng, out_shape, affine, recipe=False):
    """``random_affine`` (the same draw) with the polygons warped: their visible parts' boxes replace the
    warped boxes, and rows keep a hundredth of their area at least (the reference's threshold with polygons)."""
    return _warp(image, boxes, classes, polygons, has, affine_plan(rng, image.shape[:2], tuple(out_shape), **affine),
                 affine, recipe)


def _warp(image, boxes, classes, polygons, has, plan, affine, recipe=False):
    """The warp of an image, or with ``recipe`` of a frame of sources (``recipes.frame_view``: the device warps
    its pixels)."""
    image = frame_view(image, plan) if recipe else warp_image(image, plan, perspective=bool(affine["perspective"]))
    boxes, classes, polygons, kept = affine_polygons(plan, np.asarray(boxes, np.float32).reshape(-1, 4),
                                                     np.asarray(classes, np.int64), polygons)
    return image, boxes, classes, polygons, has[kept]


def _mosaic_polygons(ds: Any, rows: list, canvas: Any, plan: Any = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The Mosaic's rows' polygons, resized by their sample's ratio and placed as ``mosaic.mosaic4_polygons`` places
    them (``place_in_tiles``). ``rows``: each sample's image, boxes, ratio and the rows the Mosaic kept.

    With the affine ``plan`` to come (no perspective), only the rows it may show: a row whose polygon's extent
    (its points', or its box's for a box row, shifted with its tile and cut to it) lands wholly beyond one edge
    of the output, by a pixel at least, would get an empty box and be dropped by the warp (``affine_polygons``),
    so its polygon is neither placed nor warped.

    Returns:
        ``(polygons, has, shown)``: float32 [G', K, 2] and bool [G'] (False: a box row) of the rows shown, and
        bool [G] over the Mosaic's rows, which are.
    """
    cached = [_resampled(ds, j) for j, *_ in rows]                               # rows resampled below, if shown
    counts = [len(k) for *_, k in rows]
    frame = np.repeat(np.array([(*r, x1 - sx, y1 - sy, x1, y1, x2, y2) for (_, _, r, _), (_, x1, y1, x2, y2, sx, sy)
                                in zip(rows, canvas.tiles, strict=True)], np.float64).reshape(-1, 8), counts, 0)
    boxes = np.concatenate([np.asarray(b, np.float32).reshape(-1, 4)[k] for _, b, _, k in rows])     # [G, 4]
    shown = np.ones(len(boxes), bool)
    if plan is not None and len(boxes) and np.array_equal(plan.box_m[2], [0.0, 0.0, 1.0]):
        extents = np.concatenate([c[2][k] for c, (*_, k) in zip(cached, rows, strict=True)])  # NaN: a box row
        e = np.where(np.isnan(extents), boxes, extents * frame[:, [0, 1, 0, 1]]) + frame[:, [2, 3, 2, 3]]
        e = e.clip(frame[:, [4, 5, 4, 5]], frame[:, [6, 7, 6, 7]])
        shown = _shown(e, plan)
    starts = list(itertools.accumulate(counts, initial=0))
    takes = [k[shown[a:b]] for (*_, k), a, b in zip(rows, starts[:-1], starts[1:], strict=True)]
    cached = [_resampled(ds, j, t) for (j, *_), t in zip(rows, takes, strict=True)]
    polygons = np.concatenate([np.take(c[0], t, 0) for c, t in zip(cached, takes, strict=True)])  # f32 [G', K, 2]
    has = np.concatenate([c[1][t] for c, t in zip(cached, takes, strict=True)])
    ratio = np.repeat(np.array([r for _, _, r, _ in rows], np.float32).reshape(-1, 1, 2), [len(t) for t in takes], 0)
    polygons *= ratio.repeat(polygons.shape[1], 1)                        # ``place_rows``' ratio
    if not has.all():                                                     # box rows: their outlines
        polygons[~has] = box_outlines(boxes[shown][~has])
    return place_in_tiles(polygons, canvas, [len(t) for t in takes]), has, shown


def _shown(extents: np.ndarray, plan: Any) -> np.ndarray:
    """Which boxes (float64 [G, 4] xyxy) an affine ``plan`` (no perspective) leaves within a pixel of its output:
    not wholly beyond one of its edges by more. Each warped corner's extent in one product: the lowest x of a
    box's warped corners takes each coefficient's lower end (x1 for a positive coefficient of x, x2 for a
    negative one), the highest its higher end."""
    (a, b, c), (d, f, g) = plan.box_m[:2].tolist()
    pick = np.zeros((4, 4))                     # columns: the lowest x and y, the highest x and y
    for row, (cx, cy) in enumerate(((a, b), (d, f))):
        pick[0 if cx >= 0 else 2, row], pick[1 if cy >= 0 else 3, row] = cx, cy
        pick[2 if cx >= 0 else 0, row + 2], pick[3 if cy >= 0 else 1, row + 2] = cx, cy
    span = extents @ pick + (c, g, c, g)
    h, w = plan.out_shape
    return (span[:, 2:] >= -1).all(1) & (span[:, 0] <= w + 1) & (span[:, 1] <= h + 1)


def mask_parts(items: list[dict], h: int, w: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The shapes and dtypes of :func:`collate_masks`' two tensors, ``masks`` and ``mask_rows``."""
    first = items[0]
    ratio = (first["image"].shape[1] if "image" in first else first[RECIPE_KEY]["shape"][0]) // first["masks"].shape[-2]
    overlap = first["masks"].ndim == 2
    dtype = torch.int32 if any(it["masks"].dtype == torch.int32 for it in items) else torch.uint8
    n = len(items) if overlap else sum(len(it["masks"]) for it in items)
    return [((n, h // ratio, w // ratio), dtype), ((sum(len(it["mask_rows"]) for it in items),), torch.bool)]


def collate_masks(items: list[dict], h: int, w: int, out: list[torch.Tensor] | None = None) -> dict:
    """A segmentation batch's ``masks`` and ``mask_rows`` (the images ``h`` x ``w``, each item's masks at the same
    ratio, padded with background as the images are with grey): index maps [B, h/r, w/r] (int32 when an item's
    is), or per-row masks [N, h/r, w/r] in the order of ``targets``' rows; ``mask_rows`` bool [N] likewise.
    ``out``: the two tensors to write, of :func:`mask_parts`' shapes (the loader's: in the images' buffer)."""
    masks, rows = out if out is not None else [torch.empty(shape, dtype=dtype)
                                               for shape, dtype in mask_parts(items, h, w)]
    masks.zero_()
    row = 0
    for i, it in enumerate(items):
        m = it["masks"]
        if m.ndim == 2:                                # overlap_mask: one index map per item
            masks[i, :m.shape[0], :m.shape[1]] = m
        else:
            masks[row:row + len(m), :m.shape[1], :m.shape[2]] = m
            row += len(m)
    torch.cat([it["mask_rows"] for it in items], out=rows)
    return {"masks": masks, "mask_rows": rows}
