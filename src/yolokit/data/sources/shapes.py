"""`shapes`: the built-in synthetic detection set, written as a normal YOLO dataset.

Coloured circles, rectangles, triangles and stars on textured backgrounds, sizes
from tiny to large, overlapping and partly occluded, some images with no object.
The set is a pure function of its parameters and seed: it is generated once into a
cache folder named by a hash of the parameters, atomically (built in a temporary
folder, then renamed), and read back by the same code as any real dataset.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cv2
import numpy as np

from yolokit.data.sources.labels import cache_home

SHAPE_NAMES = ("circle", "rectangle", "triangle", "star")
"""The built-in shapes set's class names, in class-index order."""
_FORMAT = 3  # bump when the drawing code changes, so old caches are not reused


def make_shapes(
    path: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    n_train: int = 400,
    n_val: int = 80,
    imgsz: int = 320,
    max_objects: int = 6,
    background_fraction: float = 0.08,
    jpeg_quality: int = 90,
    segments: bool = False,
) -> Path:
    """Generate (once) the shapes dataset and return its data.yaml.

    Args:
        path: folder to write; default `<cache_home()>/shapes-<hash of the parameters>`
            where cache_home() is $YOLOKIT_CACHE or ~/.cache/yolokit.
        seed: everything is drawn from numpy Generators seeded by (seed, split, image).
        n_train: training images.
        n_val: validation images.
        imgsz: long side of every image in pixels (aspect ratios vary).
        max_objects: most objects in one image.
        background_fraction: share of images with no object.
        jpeg_quality: JPEG quality of the written images.
        segments: label each object by its outline, as YOLO segmentation rows (``class x1 y1 x2 y2
            ...``, normalized): the same images, for instance segmentation ("shapes-seg" as a source).

    Returns:
        Path of data.yaml (classes: circle, rectangle, triangle, star).

    Raises:
        FileExistsError: `path` already holds something else.

    Examples:
        >>> yaml_path = make_shapes(n_train=8, n_val=4, imgsz=128)  # doctest: +SKIP
        >>> yaml_path.name
        'data.yaml'
    """
    params = {"format": _FORMAT, "seed": seed, "n_train": n_train, "n_val": n_val,
              "imgsz": imgsz, "max_objects": max_objects,
              "background_fraction": background_fraction, "jpeg_quality": jpeg_quality}
    if segments:                    # only then: a detection set's parameters, hash and folder stay as they were
        params["segments"] = True
    tag = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]
    final = Path(path) if path is not None else cache_home() / f"shapes{'-seg' if segments else ''}-{tag}"
    final = final.expanduser().resolve()
    if _matches(final, params):
        return final / "data.yaml"
    if final.exists() and (not final.is_dir() or any(final.iterdir())):
        raise FileExistsError(f"{final} exists and is not this shapes dataset")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        _write_dataset(tmp, final, params)
        if final.is_dir():
            final.rmdir()  # an empty folder the caller made
        os.rename(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if _matches(final, params):  # another process finished the same set first
            return final / "data.yaml"
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final / "data.yaml"


def _matches(folder: Path, params: dict) -> bool:
    try:
        return json.loads((folder / "shapes.json").read_text()) == params and (
            folder / "data.yaml").is_file()
    except (OSError, ValueError):
        return False


def _write_dataset(tmp: Path, final: Path, params: dict) -> None:
    jobs = []
    for split_id, (split, n) in enumerate((("train", params["n_train"]), ("val", params["n_val"]))):
        (tmp / "images" / split).mkdir(parents=True)
        (tmp / "labels" / split).mkdir(parents=True)
        jobs += [(tmp, split, split_id, i, params) for i in range(n)]
    with ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
        list(pool.map(lambda j: _write_image(*j), jobs))
    names = "\n".join(f"  {i}: {n}" for i, n in enumerate(SHAPE_NAMES))
    (tmp / "data.yaml").write_text(
        f"# yolokit shapes set, seed {params['seed']}\npath: {final}\n"
        f"train: images/train\nval: images/val\nnames:\n{names}\n")
    (tmp / "shapes.json").write_text(json.dumps(params, sort_keys=True))


def _write_image(root: Path, split: str, split_id: int, i: int, params: dict) -> None:
    rng = np.random.default_rng([params["seed"], split_id, i])
    outlines: list[np.ndarray] = []
    image, labels = draw_shapes_image(rng, imgsz=params["imgsz"],
                                      max_objects=params["max_objects"],
                                      background_fraction=params["background_fraction"], outlines=outlines)
    h, w = image.shape[:2]
    if params.get("segments"):      # each shape's outline as drawn, cut to the part inside the image
        rows = [f"{c} " + " ".join(f"{x:.6f} {y:.6f}" for x, y in (clip_polygon(pts, w, h) / [w, h]).clip(0, 1))
                for (c, *_), pts in zip(labels, outlines, strict=True)]
    else:
        rows = [f"{c} {(x1 + x2) / 2 / w:.6f} {(y1 + y2) / 2 / h:.6f} {(x2 - x1) / w:.6f} "
                f"{(y2 - y1) / h:.6f}" for c, x1, y1, x2, y2 in labels]
    name = f"{split}_{i:06d}"
    ok = cv2.imwrite(str(root / "images" / split / f"{name}.jpg"), image,
                     [cv2.IMWRITE_JPEG_QUALITY, params["jpeg_quality"]])
    if not ok:
        raise OSError(f"could not write {name}.jpg")
    (root / "labels" / split / f"{name}.txt").write_text("\n".join(rows) + ("\n" if rows else ""))


def draw_shapes_image(
    rng: np.random.Generator, *, imgsz: int = 320, max_objects: int = 6,
    background_fraction: float = 0.08, outlines: list[np.ndarray] | None = None,
) -> tuple[np.ndarray, list[tuple[int, float, float, float, float]]]:
    """Draw one synthetic image.

    Args:
        rng: the only source of randomness.
        imgsz: long side in pixels.
        max_objects: most objects.
        background_fraction: probability of an image with no object.
        outlines: a list to receive each labelled shape's polygon (float64 [K, 2] pixels, as filled),
            in the order of ``labels``; the image and draws are the same without it.

    Returns:
        image: uint8 [H, W, 3] BGR.
        labels: (class, x1, y1, x2, y2) in pixels, tight around the drawn shape
            (clipped to the image).
    """
    aspect = rng.choice([1.0, 1.0, 4 / 3, 3 / 4, 1.5])
    w, h = (imgsz, round(imgsz / aspect)) if aspect >= 1 else (round(imgsz * aspect), imgsz)
    image = _background(rng, h, w)
    mean = image.reshape(-1, 3).mean(0)
    n = 0 if rng.random() < background_fraction else int(rng.integers(1, max_objects + 1))
    labels: list[tuple[int, float, float, float, float]] = []
    for _ in range(n):
        for _attempt in range(10):
            cls = int(rng.integers(len(SHAPE_NAMES)))
            size = imgsz * math.exp(rng.uniform(math.log(0.05), math.log(0.5)))
            cx, cy = rng.uniform(0, w), rng.uniform(0, h)
            pts = _outline(rng, cls, cx, cy, size).astype(np.int32)
            box = _pixel_extent(pts, h, w)
            if box is None or box[2] - box[0] < 4 or box[3] - box[1] < 4:
                continue
            if all(_covered(box, b[1:]) < 0.6 and _covered(b[1:], box) < 0.6 for b in labels):
                break
        else:
            continue
        cv2.fillPoly(image, [pts], _colour(rng, mean), lineType=cv2.LINE_8)
        labels.append((cls, *box))
        if outlines is not None:
            outlines.append(pts.astype(np.float64))
    # mild sensor noise: a random 64 px tile of +-4, tiled (cheap and seeded)
    tile = rng.integers(0, 9, (64, 64, 3), dtype=np.uint8)
    reps = (-(-h // 64), -(-w // 64), 1)
    noise = np.tile(tile, reps)[:h, :w]
    image = cv2.subtract(cv2.add(image, noise), np.full_like(noise, 4))
    return image, labels


def clip_polygon(points: np.ndarray, width: float, height: float) -> np.ndarray:
    """The part of a polygon (float [K, 2], any shape) inside ``[0, width] x [0, height]``: Sutherland and
    Hodgman's clipping by each border in turn (a part cut in two stays one outline, joined along the border)."""
    poly = np.asarray(points, np.float64).reshape(-1, 2)
    for axis, limit, keep_below in ((0, 0.0, False), (0, float(width), True), (1, 0.0, False),
                                    (1, float(height), True)):
        if not len(poly):
            break
        inside = poly[:, axis] <= limit if keep_below else poly[:, axis] >= limit
        out = []
        for k in range(len(poly)):
            a, b = poly[k - 1], poly[k]
            if inside[k] != inside[k - 1]:                   # the edge a -> b crosses the border
                t = (limit - a[axis]) / (b[axis] - a[axis])
                out.append(a + t * (b - a))
            if inside[k]:
                out.append(b)
        poly = np.array(out, np.float64).reshape(-1, 2)
    return poly


def _pixel_extent(pts: np.ndarray, h: int, w: int) -> tuple[float, float, float, float] | None:
    """Pixel-edge box of what fillPoly paints for `pts` inside an h x w image (None if nothing)."""
    x0, y0 = max(0, int(pts[:, 0].min())), max(0, int(pts[:, 1].min()))
    x1, y1 = min(w, int(pts[:, 0].max()) + 1), min(h, int(pts[:, 1].max()) + 1)
    if x1 <= x0 or y1 <= y0:
        return None
    mask = np.zeros((y1 - y0, x1 - x0), np.uint8)
    cv2.fillPoly(mask, [(pts - np.array([x0, y0])).astype(np.int32)], 1, lineType=cv2.LINE_8)
    ys, xs = np.nonzero(mask)
    if len(xs) == 0:
        return None
    return (float(x0 + xs.min()), float(y0 + ys.min()), float(x0 + xs.max() + 1),
            float(y0 + ys.max() + 1))


def _covered(a, b) -> float:
    """Share of box a's area that box b covers."""
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    return iw * ih / max((a[2] - a[0]) * (a[3] - a[1]), 1e-9)


def _outline(rng: np.random.Generator, cls: int, cx: float, cy: float, size: float) -> np.ndarray:
    """Integer polygon [K, 2] of one shape of class `cls`, about `size` across."""
    r, turn = size / 2, rng.uniform(0, 2 * math.pi)
    if cls == 0:  # circle
        t = np.linspace(0, 2 * math.pi, 48, endpoint=False)
        xy = np.stack([np.cos(t), np.sin(t)], 1) * r
    elif cls == 1:  # rectangle, any aspect, any rotation
        aspect = math.exp(rng.uniform(-0.8, 0.8))
        bw, bh = size * math.sqrt(aspect) / 1.3, size / math.sqrt(aspect) / 1.3
        xy = np.array([[-bw, -bh], [bw, -bh], [bw, bh], [-bw, bh]]) / 2
        xy = xy @ _rotation(turn if rng.random() < 0.5 else 0.0).T
    elif cls == 2:  # triangle with corners spread at least 80 degrees apart
        gaps = rng.uniform(80, 140, 2)
        angles = np.radians([0, gaps[0], gaps[0] + gaps[1]]) + turn
        xy = np.stack([np.cos(angles), np.sin(angles)], 1) * r
    else:  # five-pointed star
        t = turn + np.arange(10) * math.pi / 5
        rad = np.where(np.arange(10) % 2 == 0, r, r * 0.45)
        xy = np.stack([np.cos(t) * rad, np.sin(t) * rad], 1)
    return np.round(xy + [cx, cy])


def _rotation(a: float) -> np.ndarray:
    return np.array([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]])


def _colour(rng: np.random.Generator, avoid: np.ndarray) -> tuple[int, int, int]:
    """A random colour at least 120 (L1) away from the background mean."""
    best, best_d = None, -1.0
    for _ in range(8):
        c = rng.integers(0, 256, 3)
        d = float(np.abs(c - avoid).sum())
        if d > best_d:
            best, best_d = c, d
        if d >= 120:
            break
    return tuple(int(v) for v in best)


def _background(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """Textured background [h, w, 3]: gradient, smooth noise, stripes or checks."""
    base = rng.integers(40, 216, 3)
    amp = rng.uniform(15, 45)
    kind = rng.integers(4)
    xx = np.arange(w, dtype=np.float32)[None, :]
    yy = np.arange(h, dtype=np.float32)[:, None]
    if kind == 0:
        a = rng.uniform(0, 2 * math.pi)
        t = (np.cos(a) * xx + np.sin(a) * yy) / max(h, w)
        planes, gains = [t - t.mean()] * 3, rng.uniform(-2, 2, 3)
    elif kind == 1:
        small = rng.normal(0, 1, (max(2, h // 32), max(2, w // 32), 3)).astype(np.float32)
        smooth = cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)
        planes, gains = cv2.split(smooth), [0.6] * 3
    elif kind == 2:
        a, period = rng.uniform(0, math.pi), rng.uniform(8, 40)
        t = np.sin((np.cos(a) * xx + np.sin(a) * yy) * np.float32(2 * math.pi / period))
        planes, gains = [t] * 3, rng.uniform(-1, 1, 3)
    else:
        cell = int(rng.integers(8, 40))
        t = (((xx // cell + yy // cell) % 2) * 2 - 1).astype(np.float32)
        planes, gains = [t] * 3, rng.uniform(-1, 1, 3)
    # base + amp * gain * texture per channel, saturated to uint8 (|.| keeps it a texture)
    return cv2.merge([cv2.convertScaleAbs(np.ascontiguousarray(planes[c], np.float32),
                                          alpha=float(amp * gains[c]), beta=float(base[c]))
                      for c in range(3)])
