"""Image-and-box transforms on numpy arrays, with randomness from an explicit Generator.

Images are uint8 `[H, W, 3]` (BGR inside the pipeline; nothing here depends on the
channel order). Boxes are float32 `[G, 4]` xyxy in pixel-edge coordinates (the box
`[0, 0, W, H]` is the whole image), classes `[G]`. Every random transform takes a
`numpy.random.Generator` and nothing else random.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cv2
import numpy as np

from yolokit.data.sources.images import PAD_VALUE


@dataclass
class AugmentConfig:
    """Training augmentation strengths; defaults are YOLOv8's well-known ones.

    Attributes:
        hsv_h: hue gain range (fraction of the hue circle)
        hsv_s: saturation gain range (fraction)
        hsv_v: value (brightness) gain range (fraction)
        degrees: rotation range (+- degrees)
        translate: shift range (fraction of the image size)
        scale: zoom range (1 +- scale)
        shear: shear range (+- degrees)
        perspective: perspective range (fraction, typically 0 to 0.001)
        flipud: probability of an up-down flip
        fliplr: probability of a left-right flip
        mosaic: probability of a Mosaic of 4 images
        mosaic_tiles: images in a Mosaic: 4, or 9 (the reference's 9-image layout: `mosaic.mosaic9_rows`;
            the loader's workers only, not ``augment_on="device"``)
        mixup: probability of MixUp with a second image
        copy_paste: segmentation sets only: probability of pasting the image's objects mirrored
            left-right onto it, before the affine step (`polygons.copy_paste`)
        hue_mode: "gain" (hue x (1 + g), up to Ultralytics 8.3.78) or "shift" (hue + 180 g, 8.4's); g in +-hsv_h
    """

    hsv_h: float = 0.015
    hsv_s: float = 0.7
    hsv_v: float = 0.4
    degrees: float = 0.0
    translate: float = 0.1
    scale: float = 0.5
    shear: float = 0.0
    perspective: float = 0.0
    flipud: float = 0.0
    fliplr: float = 0.5
    mosaic: float = 1.0
    mixup: float = 0.0
    copy_paste: float = 0.0
    mosaic_tiles: int = 4
    hue_mode: str = "gain"

    def __post_init__(self) -> None:
        if self.mosaic_tiles not in (4, 9):
            raise ValueError(f"mosaic_tiles must be 4 or 9, got {self.mosaic_tiles!r}")
        if self.hue_mode not in ("gain", "shift"):
            raise ValueError(f"hue_mode must be 'gain' or 'shift', got {self.hue_mode!r}")


def scale_boxes(boxes: np.ndarray, ratio: tuple[float, float],
                pad: tuple[float, float]) -> np.ndarray:
    """Map xyxy boxes [G, 4] by `box * ratio + pad` (what `letterbox` did to the image:
    `scale_boxes(boxes, *ratio_pad)`; `ops.geometry.unletterbox_boxes` maps back)."""
    rw, rh = ratio
    return (boxes * np.array([rw, rh, rw, rh], np.float32)
            + np.array([pad[0], pad[1], pad[0], pad[1]], np.float32)).astype(np.float32)


def affine_matrix(
    rng: np.random.Generator,
    in_shape: tuple[int, int],
    out_shape: tuple[int, int],
    *,
    degrees: float = 0.0,
    translate: float = 0.1,
    scale: float = 0.5,
    shear: float = 0.0,
    perspective: float = 0.0,
) -> tuple[np.ndarray, float]:
    """Draw a random 3x3 transform from input to output pixel centres.

    The input centre goes to the output centre, then perspective, rotation and
    scale, shear, and a translation of up to `translate` of the output size.

    Returns:
        M: float64 [3, 3], and the drawn scale factor.
    """
    centre = np.eye(3)
    centre[0, 2], centre[1, 2] = -in_shape[1] / 2, -in_shape[0] / 2
    persp = np.eye(3)
    persp[2, 0], persp[2, 1] = rng.uniform(-perspective, perspective, 2)
    angle, s = rng.uniform(-degrees, degrees), rng.uniform(1 - scale, 1 + scale)
    rot = np.eye(3)
    rot[:2] = cv2.getRotationMatrix2D((0, 0), angle, s)
    sh = np.eye(3)
    sh[0, 1], sh[1, 0] = np.tan(np.radians(rng.uniform(-shear, shear, 2)))
    move = np.eye(3)
    move[0, 2] = rng.uniform(0.5 - translate, 0.5 + translate) * out_shape[1]
    move[1, 2] = rng.uniform(0.5 - translate, 0.5 + translate) * out_shape[0]
    return move @ sh @ rot @ persp @ centre, s


def transform_boxes(boxes: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Transform xyxy boxes [G, 4] through their four corners; returns their bounding boxes.

    `m` maps pixel centres (OpenCV's convention); boxes use pixel edges, so the
    half-pixel shift is applied around it.
    """
    if len(boxes) == 0:
        return np.zeros((0, 4), np.float32)
    x1, y1, x2, y2 = (boxes[:, i].astype(np.float64) - 0.5 for i in range(4))
    xs = np.stack([x1, x2, x2, x1], 1)
    ys = np.stack([y1, y1, y2, y2], 1)
    pts = np.stack([xs, ys, np.ones_like(xs)], -1) @ m.T  # [G, 4, 3]
    xy = pts[..., :2] / pts[..., 2:3]
    out = np.concatenate([xy.min(1), xy.max(1)], 1) + 0.5
    return out.astype(np.float32)


def box_candidates(before: np.ndarray, after: np.ndarray, *, scale: float = 1.0,
                   min_size: float = 2.0, area_thr: float = 0.1,
                   ar_thr: float = 100.0) -> np.ndarray:
    """Which transformed boxes to keep.

    Args:
        before: [G, 4] boxes before the transform.
        after: [G, 4] the same boxes after it (clipped).
        scale: the transform's zoom, so areas are compared at the same scale.
        min_size: least width and height in pixels.
        area_thr: least kept share of the (scaled) original area.
        ar_thr: largest aspect ratio.

    Returns:
        bool [G].
    """
    w1, h1 = before[:, 2] - before[:, 0], before[:, 3] - before[:, 1]
    w2, h2 = after[:, 2] - after[:, 0], after[:, 3] - after[:, 1]
    ar = np.maximum(w2 / np.maximum(h2, 1e-9), h2 / np.maximum(w2, 1e-9))
    return ((w2 > min_size) & (h2 > min_size)
            & (w2 * h2 / np.maximum(w1 * h1 * scale * scale, 1e-9) > area_thr) & (ar < ar_thr))


def random_affine(
    image: np.ndarray,
    boxes: np.ndarray,
    classes: np.ndarray,
    rng: np.random.Generator,
    *,
    out_shape: tuple[int, int] | None = None,
    degrees: float = 0.0,
    translate: float = 0.1,
    scale: float = 0.5,
    shear: float = 0.0,
    perspective: float = 0.0,
    pad_value: int = PAD_VALUE,
    area_thr: float = 0.1,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random rotation, scale, shear, translation and perspective.

    Args:
        image: [h, w, 3], or a Mosaic canvas that paints on demand (`MosaicCanvas`): a
            pure scale + translation then reads only the part that lands in the output.
        boxes: [G, 4] xyxy pixels; classes: [G].
        rng: source of randomness.
        out_shape: output `(H, W)`; default the input size (Mosaic passes half its canvas).
        degrees, translate, scale, shear, perspective: ranges, as in AugmentConfig.
        pad_value: fill for uncovered pixels.
        area_thr: boxes keeping less than this share of their area are dropped.

    Returns:
        image [H, W, 3], boxes [G', 4] (clipped to the image), classes [G'].
    """
    plan = affine_plan(rng, image.shape[:2], tuple(out_shape or image.shape[:2]), degrees=degrees,
                       translate=translate, scale=scale, shear=shear, perspective=perspective)
    image = warp_image(image, plan, perspective=bool(perspective), pad_value=pad_value)
    boxes, classes = affine_boxes(plan, boxes, classes, area_thr=area_thr)
    return image, boxes, classes


def warp_image(image: np.ndarray, plan: AffinePlan, *, perspective: bool, pad_value: int = PAD_VALUE) -> np.ndarray:
    """`random_affine`'s image: ``image`` (or a Mosaic canvas) realised by ``plan``; ``perspective``: a drawn
    perspective range (a full perspective warp)."""
    dsize = (plan.out_shape[1], plan.out_shape[0])
    border = (pad_value,) * 3
    if plan.kind == "empty":
        return np.full((*plan.out_shape, 3), pad_value, np.uint8)
    if plan.kind == "paste":
        return _paste(image, plan.spans, plan.out_shape, pad_value)  # 3x faster than a warp
    if perspective:
        return cv2.warpPerspective(np.asarray(image), plan.m, dsize, borderValue=border)
    return cv2.warpAffine(np.asarray(image), plan.m[:2], dsize, borderValue=border)


@dataclass
class AffinePlan:
    """What `random_affine` draws and how it realises it, without the pixels.

    Attributes:
        m: float64 [3, 3], the drawn map of input to output pixel centres (`affine_matrix`).
        s: the drawn scale factor.
        out_shape: output `(H, W)`.
        kind: "warp" (a full warp by `m`), "paste" (a pure scale + translation: the visible part of
            the input resized and pasted at a whole-pixel offset) or "empty" (a paste that shows nothing).
        spans: "paste" only: `((a, b, x_lo, x_hi), (c, d, y_lo, y_hi))`, input columns `[a, b)` resized
            to output columns `[x_lo, x_hi)`, rows the same.
        box_m: the matrix the boxes follow: `m`, or the one the paste realises (the scale adjusted by
            under a pixel over the span, the offset rounded to whole pixels).
    """

    m: np.ndarray
    s: float
    out_shape: tuple[int, int]
    kind: str
    spans: tuple | None
    box_m: np.ndarray


def affine_plan(rng: np.random.Generator, in_shape: tuple[int, int], out_shape: tuple[int, int],
                **ranges: float) -> AffinePlan:
    """Draw `random_affine`'s transform (the same numbers from `rng`) and decide how it is realised.

    Args:
        rng: source of randomness.
        in_shape, out_shape: input and output `(H, W)`.
        ranges: degrees, translate, scale, shear, perspective (as in AugmentConfig).
    """
    out_shape = (int(out_shape[0]), int(out_shape[1]))
    m, s = affine_matrix(rng, in_shape, out_shape, **ranges)
    if not (m[0, 1] == 0 and m[1, 0] == 0 and m[2, 0] == 0 and m[2, 1] == 0):
        return AffinePlan(m, s, out_shape, "warp", None, m)
    spans, exact = _paste_spans(m, in_shape, out_shape)
    return AffinePlan(m, s, out_shape, "paste" if spans else "empty", spans, exact)


def _paste_spans(m: np.ndarray, in_shape: tuple[int, int],
                 out_shape: tuple[int, int]) -> tuple[tuple | None, np.ndarray]:
    """A pure scale + translation as a paste: the spans ``((a, b, x_lo, x_hi), (c, d, y_lo, y_hi))`` and the
    matrix it realises; ``(None, m)`` when nothing is visible."""
    exact, spans = np.eye(3), []
    for axis, n_in, n_out in ((0, in_shape[1], out_shape[1]), (1, in_shape[0], out_shape[0])):
        sc = m[axis, axis]
        t = m[axis, 2] + 0.5 - 0.5 * sc  # in pixel-edge coordinates: out = sc * in + t
        a, b = max(0, math.floor(-t / sc)), min(n_in, math.ceil((n_out - t) / sc))
        if b <= a:  # nothing visible
            return None, m
        lo, hi = round(a * sc + t), round(b * sc + t)
        hi = max(hi, lo + 1)
        r = (hi - lo) / (b - a)
        exact[axis, axis], exact[axis, 2] = r, lo - a * r + 0.5 * r - 0.5
        spans.append((a, b, lo, hi))
    return tuple(spans), exact


def affine_boxes(plan: AffinePlan, boxes: np.ndarray, classes: np.ndarray, *,
                 area_thr: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """`random_affine`'s boxes and classes: through `plan.box_m`, clipped, the too small ones dropped."""
    out_shape = plan.out_shape
    new = transform_boxes(boxes, plan.box_m)
    new[:, [0, 2]] = new[:, [0, 2]].clip(0, out_shape[1])
    new[:, [1, 3]] = new[:, [1, 3]].clip(0, out_shape[0])
    keep = box_candidates(boxes, new, scale=plan.s, area_thr=area_thr)
    return new[keep], classes[keep]


def affine_polygons(plan: AffinePlan, boxes: np.ndarray, classes: np.ndarray, polygons: np.ndarray, *,
                    area_thr: float = 0.01) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`affine_boxes` for rows with polygons (float32 [G, K, 2]): each polygon through `plan.box_m`, its visible
    part's box replacing its warped box (`polygons.warp_polygons`), the rows kept as `box_candidates` decides
    against the boxes before (the reference's ``area_thr`` for polygons, 0.01).

    Returns:
        boxes [G', 4], classes [G'], polygons float32 [G', K, 2] (each point within its box), and the int64
        indices [G'] of the rows kept.
    """
    from yolokit.data.augment.polygons import warp_polygons

    h, w = plan.out_shape
    new, warped = warp_polygons(np.asarray(polygons, np.float32), plan.box_m, (w, h))
    new = np.asarray(new, np.float32).reshape(-1, 4)
    np.clip(new[:, 0::2], 0, w, out=new[:, 0::2])
    np.clip(new[:, 1::2], 0, h, out=new[:, 1::2])
    kept = np.flatnonzero(box_candidates(boxes, new, scale=plan.s, area_thr=area_thr))
    return new[kept], classes[kept], np.take(warped, kept, 0).astype(np.float32), kept


def _resize_and_paste(image: np.ndarray, m: np.ndarray, out_shape: tuple[int, int],
                      pad_value: int) -> tuple[np.ndarray, np.ndarray]:
    """Apply a pure scale + translation by resizing only the visible part of the image and
    pasting it at a whole-pixel offset.

    Returns:
        the image [H, W, 3] and the matrix actually realised (the scale adjusted by under a
        pixel over the span, the offset rounded to whole pixels), for the boxes.
    """
    spans, exact = _paste_spans(m, image.shape[:2], out_shape)
    if spans is None:
        return np.full((*out_shape, 3), pad_value, np.uint8), m
    return _paste(image, spans, out_shape, pad_value), exact


def _paste(image: np.ndarray, spans: tuple, out_shape: tuple[int, int], pad_value: int) -> np.ndarray:
    """`affine_plan`'s "paste": input columns [a, b) and rows [c, d) resized to output [x_lo, x_hi) x [y_lo, y_hi)."""
    (a, b, x_lo, x_hi), (c, d, y_lo, y_hi) = spans
    x0, y0 = max(x_lo, 0), max(y_lo, 0)
    x1, y1 = min(x_hi, out_shape[1]), min(y_hi, out_shape[0])
    size = (x_hi - x_lo, y_hi - y_lo)
    out = np.empty((*out_shape, 3), np.uint8)        # grey only around the pasted part: each pixel written once
    out[:y0], out[y1:], out[y0:y1, :x0], out[y0:y1, x1:] = pad_value, pad_value, pad_value, pad_value
    if (x0, y0, x1, y1) == (x_lo, y_lo, x_hi, y_hi):  # fits: resize straight into place
        cv2.resize(image[c:d, a:b], size, dst=out[y0:y1, x0:x1], interpolation=cv2.INTER_LINEAR)
    else:
        patch = cv2.resize(image[c:d, a:b], size, interpolation=cv2.INTER_LINEAR)
        out[y0:y1, x0:x1] = patch[y0 - y_lo:y1 - y_lo, x0 - x_lo:x1 - x_lo]
    return out


def hsv_lut(rng: np.random.Generator, *, h: float = 0.015, s: float = 0.7,
            v: float = 0.4, hue: str = "gain") -> np.ndarray | None:
    """Draw random hue, saturation and value gains; their lookup tables.

    Args:
        rng: source of randomness (three numbers are drawn when any range is set).
        h, s, v: gain ranges; each gain is 1 + uniform(-range, range).
        hue: ``"gain"`` multiplies the hue by its gain; ``"shift"`` adds (gain - 1) x 180 (the reference 8.4's).

    Returns:
        uint8 [3, 256]: the new OpenCV hue (0..179), saturation and value of each old one;
        None when all ranges are 0 (nothing drawn).
    """
    if not (h or s or v):
        return None
    gain = (draw := rng.uniform(-1, 1, 3) * (h, s, v)) + 1
    x = np.arange(256, dtype=np.float32)
    hues = (x * gain[0]) % 180 if hue == "gain" else (np.arange(256, dtype=np.float64) + draw[0] * 180) % 180
    return np.stack([hues, np.clip(x * gain[1], 0, 255), np.clip(x * gain[2], 0, 255)]).astype(np.uint8)


def apply_hsv_lut(image: np.ndarray, lut: np.ndarray) -> np.ndarray:
    """Map an image's OpenCV HSV values through `lut` (uint8 [3, 256], from `hsv_lut`).

    Args:
        image: [H, W, 3] uint8 BGR (RGB works the same: the tables are symmetric).

    Returns:
        a new image [H, W, 3]. `yolokit.data.augment.color.apply_hsv_lut_batch` does the same to a
        batch of tensors on any device.
    """
    # one row: OpenCV's vector code converts all of it (the last width % 32 pixels of each row would
    # go to its scalar code, which rounds where the vector code truncates; see data/augment/color.py)
    hsv = cv2.cvtColor(np.ascontiguousarray(image).reshape(1, -1, 3), cv2.COLOR_BGR2HSV)
    return cv2.cvtColor(cv2.LUT(hsv, np.ascontiguousarray(lut.T).reshape(1, 256, 3)), cv2.COLOR_HSV2BGR).reshape(
        image.shape)


def augment_hsv(image: np.ndarray, rng: np.random.Generator, *, h: float = 0.015,
                s: float = 0.7, v: float = 0.4) -> np.ndarray:
    """Random hue, saturation and value gains, through one lookup table (`hsv_lut`, `apply_hsv_lut`).

    Args:
        image: [H, W, 3] uint8 BGR (RGB works the same: the gains are symmetric).
        rng: source of randomness.
        h, s, v: gain ranges; each gain is 1 + uniform(-range, range).

    Returns:
        a new image [H, W, 3] (the input when all ranges are 0).
    """
    return image if (lut := hsv_lut(rng, h=h, s=s, v=v)) is None else apply_hsv_lut(image, lut)


def flip_lr(image: np.ndarray, boxes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mirror left-right: image [H, W, 3], boxes [G, 4] -> the same, mirrored."""
    w = image.shape[1]
    out = boxes.copy()
    out[:, 0], out[:, 2] = w - boxes[:, 2], w - boxes[:, 0]
    return cv2.flip(image, 1), out


def flip_ud(image: np.ndarray, boxes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mirror top-bottom: image [H, W, 3], boxes [G, 4] -> the same, mirrored."""
    h = image.shape[0]
    out = boxes.copy()
    out[:, 1], out[:, 3] = h - boxes[:, 3], h - boxes[:, 1]
    return cv2.flip(image, 0), out


def random_flip(image: np.ndarray, boxes: np.ndarray, rng: np.random.Generator, *,
                fliplr: float = 0.5, flipud: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Flip left-right with probability `fliplr`, then top-bottom with `flipud`."""
    if rng.random() < fliplr:
        image, boxes = flip_lr(image, boxes)
    if rng.random() < flipud:
        image, boxes = flip_ud(image, boxes)
    return image, boxes
