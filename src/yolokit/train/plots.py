"""PNG charts drawn with OpenCV (no plotting library needed): line panels, PR curves, image grids."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from yolokit.ops.nms import Detections
from yolokit.viz import class_colour, draw_detections

PANEL = (300, 400)  # height, width of one chart panel
MARGIN = 40


def _axes(title: str, xs: np.ndarray, ys: list[np.ndarray], y_range: tuple[float, float] | None = None):
    """A white panel with a frame, a title and the mapping from data to pixels."""
    h, w = PANEL
    canvas = np.full((h, w, 3), 255, np.uint8)
    finite = np.concatenate([y[np.isfinite(y)] for y in ys] + [np.zeros(0)])
    lo, hi = y_range if y_range else ((finite.min(), finite.max()) if finite.size else (0.0, 1.0))
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    x_lo, x_hi = (float(xs.min()), float(xs.max())) if xs.size else (0.0, 1.0)
    x_hi = x_hi if x_hi > x_lo else x_lo + 1

    def to_px(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        px = MARGIN + (x - x_lo) / (x_hi - x_lo) * (w - 2 * MARGIN)
        py = h - MARGIN - (y - lo) / (hi - lo) * (h - 2 * MARGIN)
        return np.stack([px, py], -1).round().astype(np.int32)

    cv2.rectangle(canvas, (MARGIN, MARGIN), (w - MARGIN, h - MARGIN), (0, 0, 0), 1)
    cv2.putText(canvas, title, (MARGIN, MARGIN - 12), cv2.FONT_HERSHEY_SIMPLEX, 0.5, (0, 0, 0), 1, cv2.LINE_AA)
    for value, y in ((hi, MARGIN + 4), (lo, h - MARGIN)):
        cv2.putText(canvas, f"{value:.3g}", (2, y), cv2.FONT_HERSHEY_SIMPLEX, 0.35, (80, 80, 80), 1, cv2.LINE_AA)
    cv2.putText(canvas, f"{x_lo:.3g}", (MARGIN, h - MARGIN + 14), cv2.FONT_HERSHEY_SIMPLEX, 0.35, (80, 80, 80), 1)
    cv2.putText(canvas, f"{x_hi:.3g}", (w - MARGIN - 20, h - MARGIN + 14), cv2.FONT_HERSHEY_SIMPLEX, 0.35,
                (80, 80, 80), 1)
    return canvas, to_px


def _line(canvas: np.ndarray, points: np.ndarray, colour: tuple[int, int, int]) -> None:
    if len(points) == 1:
        cv2.circle(canvas, tuple(int(v) for v in points[0]), 3, colour, -1)
    else:
        cv2.polylines(canvas, [points.reshape(-1, 1, 2)], False, colour, 2, cv2.LINE_AA)


def _save(panels: list[np.ndarray], path: Path, columns: int = 2) -> Path:
    """Tiles panels into rows of ``columns`` and writes a PNG (RGB panels)."""
    rows = math.ceil(len(panels) / columns)
    blank = np.full_like(panels[0], 255)
    tiles = panels + [blank] * (rows * columns - len(panels))
    grid = np.vstack([np.hstack(tiles[r * columns:(r + 1) * columns]) for r in range(rows)])
    path.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(path), grid[..., ::-1])
    return path


def line_plots(xs: Sequence[float], series: dict[str, Sequence[float]], path: Path, title: str) -> Path | None:
    """One panel per series, y against x, written as a PNG; None when there is nothing to draw."""
    if not series:
        return None
    x = np.asarray(xs, dtype=float)
    panels = []
    for i, (name, values) in enumerate(series.items()):
        y = np.asarray(values, dtype=float)
        canvas, to_px = _axes(f"{title}: {name}", x, [y])
        ok = np.isfinite(y)
        if ok.any():
            _line(canvas, to_px(x[ok], y[ok]), class_colour(i))
        panels.append(canvas)
    return _save(panels, path)


def pr_curve_plot(recall: np.ndarray, precision: np.ndarray, names: Sequence[str], path: Path) -> Path:
    """Precision-recall at IoU 0.5: one thin line per class, the class mean in bold."""
    canvas, to_px = _axes("precision-recall (IoU 0.5)", np.asarray(recall), [np.zeros(1), np.ones(1)], (0.0, 1.0))
    valid_rows = [k for k in range(len(precision)) if (precision[k] > -1).any()]
    for k in valid_rows:
        p = np.clip(precision[k], 0, 1)
        cv2.polylines(canvas, [to_px(recall, p).reshape(-1, 1, 2)], False, class_colour(k), 1, cv2.LINE_AA)
    if valid_rows:
        mean = np.clip(precision[valid_rows], 0, 1).mean(0)
        cv2.polylines(canvas, [to_px(recall, mean).reshape(-1, 1, 2)], False, (0, 0, 0), 3, cv2.LINE_AA)
    for i, k in enumerate(valid_rows[:10]):
        label = names[k] if k < len(names) else str(k)
        cv2.putText(canvas, label, (PANEL[1] - MARGIN - 80, MARGIN + 14 + 14 * i), cv2.FONT_HERSHEY_SIMPLEX, 0.4,
                    class_colour(k), 1, cv2.LINE_AA)
    return _save([canvas], path, columns=1)


def draw_grid(samples: Sequence[tuple[np.ndarray, Any]], names: Sequence[str], path: Path, *, columns: int = 4,
              tile: int = 256, min_score: float = 0.25) -> Path:
    """Images with their detections scoring at least ``min_score`` drawn, in square tiles of a grid."""
    tiles = []
    for image, detections in samples[:16]:
        keep = detections.scores >= min_score
        shown = Detections(detections.boxes[keep], detections.scores[keep], detections.labels[keep])
        drawn = draw_detections(image, shown, names, thickness=2, font_scale=0.6)
        h, w = drawn.shape[:2]
        r = tile / max(h, w)
        resized = cv2.resize(drawn, (max(1, round(w * r)), max(1, round(h * r))))
        canvas = np.full((tile, tile, 3), 114, np.uint8)
        canvas[: resized.shape[0], : resized.shape[1]] = resized
        tiles.append(canvas)
    return _save(tiles, path, columns=min(columns, len(tiles)))
