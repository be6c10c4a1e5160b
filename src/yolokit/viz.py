"""Drawing detections on images."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import cv2
import numpy as np

from yolokit.ops.nms import Detections

__all__ = ["PALETTE", "class_colour", "draw_detections"]

# 20 well-separated RGB colours; class k uses PALETTE[k % 20].
PALETTE = np.array([
    (230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48),
    (145, 30, 180), (70, 240, 240), (240, 50, 230), (210, 245, 60), (250, 190, 212),
    (0, 128, 128), (220, 190, 255), (170, 110, 40), (255, 250, 200), (128, 0, 0),
    (170, 255, 195), (128, 128, 0), (255, 215, 180), (0, 0, 128), (128, 128, 128),
], dtype=np.uint8)
"""RGB colours of the boxes drawn, by class index modulo its length (uint8 [K, 3])."""


def class_colour(label: int) -> tuple[int, int, int]:
    """The RGB colour of class ``label``."""
    return tuple(int(v) for v in PALETTE[int(label) % len(PALETTE)])


def draw_detections(
    image: np.ndarray,
    detections: Detections,
    names: Sequence[str] | Mapping[int, str] | None = None,
    *,
    thickness: int = 2,
    font_scale: float = 0.5,
    show_scores: bool = True,
) -> np.ndarray:
    """Draws boxes with class names and scores on a copy of ``image``.

    Args:
        image: HxWx3 uint8 RGB image in the pixel frame of the detections.
        detections: boxes xyxy in pixels, scores, labels (tensors or numpy).
        names: class names by index; missing names fall back to the index.
        thickness: box line width in pixels.
        font_scale: OpenCV font scale of the captions.
        show_scores: append the score to the caption.

    Returns:
        A new HxWx3 uint8 RGB image; ``image`` is left unchanged.
    """
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ValueError(f"expected an HxWx3 uint8 RGB image, got shape {image.shape} dtype {image.dtype}")
    canvas = np.ascontiguousarray(image.copy())
    det = detections.numpy()
    h, w = canvas.shape[:2]
    for box, score, label in zip(det.boxes, det.scores, det.labels, strict=True):
        x1, y1, x2, y2 = (int(round(float(v))) for v in box)
        x1, x2 = max(0, min(x1, w - 1)), max(0, min(x2, w - 1))
        y1, y2 = max(0, min(y1, h - 1)), max(0, min(y2, h - 1))
        colour = class_colour(label)
        cv2.rectangle(canvas, (x1, y1), (x2, y2), colour, thickness)
        name = names.get(int(label), str(label)) if isinstance(names, Mapping) else (
            names[int(label)] if names is not None and int(label) < len(names) else str(int(label)))
        caption = f"{name} {float(score):.2f}" if show_scores else str(name)
        (tw, th), base = cv2.getTextSize(caption, cv2.FONT_HERSHEY_SIMPLEX, font_scale, 1)
        top = y1 - th - base if y1 - th - base >= 0 else y1
        cv2.rectangle(canvas, (x1, top), (x1 + tw, top + th + base), colour, -1)
        text = (0, 0, 0) if sum(colour) > 380 else (255, 255, 255)
        cv2.putText(canvas, caption, (x1, top + th), cv2.FONT_HERSHEY_SIMPLEX, font_scale, text, 1, cv2.LINE_AA)
    return canvas
