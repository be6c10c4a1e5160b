"""Mosaic of four images and MixUp of two, on (image, boxes, classes) samples.

Both work on samples from any source: a sample is a tuple `(image [h, w, 3] uint8,
boxes [G, 4] float32 xyxy pixels, classes [G])`. The Dataset loads the samples and
follows a Mosaic with `random_affine` back to the training size.
"""

from __future__ import annotations

import cv2
import numpy as np

from yolokit.data.transforms import PAD_VALUE

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
    if len(samples) != 4:
        raise ValueError(f"mosaic4 needs 4 samples, got {len(samples)}")
    s2 = 2 * size
    xc, yc = (int(v) for v in rng.integers(size // 2, size + size // 2, 2))
    canvas = np.full((s2, s2, 3), pad_value, np.uint8)
    all_boxes, all_classes = [], []
    for k, (image, boxes, classes) in enumerate(samples):
        h, w = image.shape[:2]
        x1, x2 = (max(xc - w, 0), xc) if k in (0, 2) else (xc, min(xc + w, s2))
        y1, y2 = (max(yc - h, 0), yc) if k in (0, 1) else (yc, min(yc + h, s2))
        sx = w - (x2 - x1) if k in (0, 2) else 0  # source offset of the shown part
        sy = h - (y2 - y1) if k in (0, 1) else 0
        canvas[y1:y2, x1:x2] = image[sy:sy + y2 - y1, sx:sx + x2 - x1]
        if len(boxes):
            b = boxes + np.array([x1 - sx, y1 - sy, x1 - sx, y1 - sy], np.float32)
            b[:, [0, 2]] = b[:, [0, 2]].clip(x1, x2)
            b[:, [1, 3]] = b[:, [1, 3]].clip(y1, y2)
            keep = (b[:, 2] > b[:, 0]) & (b[:, 3] > b[:, 1])
            all_boxes.append(b[keep])
            all_classes.append(np.asarray(classes)[keep])
    boxes = np.concatenate(all_boxes) if all_boxes else np.zeros((0, 4), np.float32)
    classes = np.concatenate(all_classes) if all_classes else np.zeros(0, np.int64)
    return canvas, boxes.astype(np.float32), classes.astype(np.int64)


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
