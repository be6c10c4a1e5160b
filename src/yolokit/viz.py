"""Drawing detections on images, and a training run's curves as a figure.

- ``draw_detections``: boxes, class names and scores on an RGB image;
- ``run_curves``: losses and metrics per epoch of a run (its folder, its ``results.csv`` or its rows),
  one panel each, as a ``matplotlib.figure.Figure`` (a notebook cell ending in one shows it).
"""

from __future__ import annotations

import csv
import functools
import io
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cv2
import numpy as np

from yolokit.ops.nms import Detections

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["CURVE_KEYS", "PALETTE", "class_colour", "curve_keys", "draw_detections", "epoch_rows", "run_curves",
           "smooth"]

CURVE_KEYS = ("train/box", "train/cls", "train/dfl", "train/obj", "precision", "recall", "mAP50", "mAP50-95")
"""The columns of ``results.csv`` that ``run_curves`` draws, one panel each, in this order: losses, then metrics."""

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
    """Draws boxes with class names and scores (and masks) on a copy of ``image``.

    Args:
        image: HxWx3 uint8 RGB image in the pixel frame of the detections.
        detections: boxes xyxy in pixels, scores, labels (tensors or numpy), and masks (drawn filled
            in the class's colour, half opaque) when they have them.
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
    if det.masks is not None and len(det.masks):   # a segmentation model's: each mask filled, half opaque
        for (x1, y1), mask, label in zip(*_mask_places(det.masks, h, w), det.labels, strict=True):
            region = canvas[y1:y1 + mask.shape[0], x1:x1 + mask.shape[1]]
            region[mask] = (region[mask] * 0.5 + np.array(class_colour(label), np.float32) * 0.5).astype(np.uint8)
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


def _mask_places(masks: Any, h: int, w: int) -> tuple[list[tuple[int, int]], list[np.ndarray]]:
    """Each mask's top-left corner in the image and its bool array: whole masks [K, h, w] at (0, 0), or
    ``ops.masks.MaskCrops``' crops at their windows (each checked to lie in the image)."""
    if hasattr(masks, "windows"):                                        # ops.masks.MaskCrops
        windows = masks.windows.tolist()
        outside = [win for win in windows if win[0] < 0 or win[1] < 0 or win[2] > w or win[3] > h]
        if outside:
            raise ValueError(f"mask window {outside[0]} lies outside the {h}x{w} image")
        return [(x1, y1) for x1, y1, _, _ in windows], [c.cpu().numpy().astype(bool) for c in masks.crops]
    if masks.shape[-2:] != (h, w):
        raise ValueError(f"masks of shape {masks.shape[-2:]} do not cover the {h}x{w} image")
    return [(0, 0)] * len(masks), list(masks)


def epoch_rows(source: str | Path) -> list[dict[str, float]]:
    """The rows of a run's ``results.csv`` (``source`` is the file or the run folder), one per epoch,
    each cell a float (empty cells left out)."""
    path = Path(source)
    path = path / "results.csv" if path.is_dir() else path
    with path.open(newline="") as f:
        return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(f)]


def curve_keys(rows: Sequence[Mapping[str, float]]) -> list[str]:
    """The quantities of ``CURVE_KEYS`` that any of ``rows`` holds, in panel order."""
    return [k for k in CURVE_KEYS if any(k in r for r in rows)]


def smooth(values: Sequence[float], sigma: float = 2.0) -> np.ndarray:
    """Gaussian smoothing over the points that are finite, weights renormalized at the ends
    (so the curve is not pulled towards zero there); NaNs stay NaN.

    Args:
        values: [N] a series.
        sigma: the Gaussian's width in points.

    Returns:
        ndarray[N] float64.
    """
    y = np.asarray(values, float)
    ok = np.isfinite(y)
    idx = np.arange(len(y))
    weights = np.exp(-0.5 * ((idx[:, None] - idx[None, :]) / sigma) ** 2) * ok[None, :]
    out = weights @ np.where(ok, y, 0.0) / np.maximum(weights.sum(1), 1e-12)
    return np.where(ok, out, np.nan)


def run_curves(run: str | Path | Sequence[Mapping[str, float]]) -> Figure:
    """Losses and metrics per epoch, one panel per quantity of ``CURVE_KEYS`` the run has: the raw
    series with markers and, from 3 points on, a smoothed dotted line; grid, titles, 4 panels a row.

    The figure is a ``matplotlib.figure.Figure`` made outside pyplot (nothing global changes, no display
    is needed): save it with ``savefig``. A notebook cell ending in it shows it as an image
    (``_repr_png_``, with or without pyplot's inline backend).

    Args:
        run: a run folder, its ``results.csv``, or its rows (dicts such as ``epoch_rows`` returns).

    Returns:
        The figure, 360 x 290 px a panel at 100 dpi.

    Raises:
        ValueError: no row holds a loss or a metric.
    """
    from matplotlib.ticker import MaxNLocator

    rows = epoch_rows(run) if isinstance(run, (str, Path)) else list(run)
    keys = curve_keys(rows)
    if not keys:
        raise ValueError(f"no epoch row with any of {', '.join(CURVE_KEYS)} to draw")
    epochs = np.array([r.get("epoch", i + 1) for i, r in enumerate(rows)], float)
    columns, lines = min(4, len(keys)), math.ceil(len(keys) / 4)
    fig = _shown_figure()(figsize=(3.6 * columns, 2.9 * lines), dpi=100, layout="constrained")
    axes = np.atleast_1d(fig.subplots(lines, columns)).reshape(-1)
    for ax, key in zip(axes, keys, strict=False):
        y = np.array([r.get(key, np.nan) for r in rows], float)
        ax.plot(epochs, y, marker=".", markersize=6, linewidth=1.5, label="results", color="#1f77b4")
        if np.isfinite(y).sum() >= 3:
            ax.plot(epochs, smooth(y), linestyle=":", linewidth=2, label="smooth", color="#ff7f0e")
        ax.set_title(key, fontsize=11)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("loss" if key.startswith("train/") else key)
        ax.grid(True, alpha=0.4)
        ax.legend(fontsize=8)
    for ax in axes[len(keys):]:
        fig.delaxes(ax)
    return fig


@functools.cache
def _shown_figure() -> type[Figure]:
    """``matplotlib.figure.Figure`` with ``_repr_png_``: IPython shows a figure made outside pyplot as text
    unless pyplot's inline backend registered its formatter; this one shows as its PNG either way (made
    here, on first use: matplotlib is imported only when a figure is drawn)."""
    from matplotlib.figure import Figure

    class ShownFigure(Figure):
        def _repr_png_(self) -> bytes:
            buffer = io.BytesIO()
            self.savefig(buffer, format="png")
            return buffer.getvalue()

    return ShownFigure
