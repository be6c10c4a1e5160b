"""Charts of a run and of a validation, drawn with matplotlib (Agg, no display needed).

- ``results_plot``: losses and metrics per epoch, raw and smoothed, one panel each
  (``yolokit.viz.run_curves``' figure);
- ``pr_curve_plot``: precision-recall at IoU 0.5 per class and for all classes;
- ``confidence_curve_plot``: F1 (or precision, recall) against confidence;
- ``confusion_matrix_plot``: the confusion matrix, normalized per true class;
- ``samples_plot``: validation images, ground truth next to predictions.

Only ``matplotlib.figure.Figure`` is used (never pyplot), so nothing global is touched and
plots can be drawn from any thread.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from yolokit.ops.nms import Detections
from yolokit.val.loop import SAMPLE_MIN_SCORE
from yolokit.viz import class_colour, curve_keys, draw_detections, run_curves

MAX_LEGEND = 20  # classes listed in a curve's legend; more are drawn in grey


def _figure(width: float, height: float) -> Any:
    """A matplotlib Figure outside pyplot (Agg canvas when saved)."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=fig.dpi)
    return path


def results_plot(rows: Sequence[dict[str, float]], path: str | Path) -> Path | None:
    """``results.png``: losses and metrics per epoch, the figure ``yolokit.viz.run_curves`` draws.
    None when no row holds a loss or a metric."""
    return _save(run_curves(rows), path) if curve_keys(rows) else None


def _class_label(names: Sequence[str], k: int) -> str:
    return names[k] if k < len(names) else str(k)


def _rgb(k: int) -> tuple[float, float, float]:
    return tuple(c / 255 for c in class_colour(k))


def pr_curve_plot(result: Any, names: Sequence[str], path: str | Path) -> Path:
    """Precision against recall at IoU 0.5 (COCO's 101 points): each class thin, the class mean
    bold, AP50 in the legend."""
    fig = _figure(7, 6)
    ax = fig.subplots()
    curves = np.asarray(result.pr_precision, float)
    recall = np.asarray(result.pr_recall, float)
    valid = [k for k in range(len(curves)) if (curves[k] > -1).any()]
    for k in valid:
        few = len(valid) <= MAX_LEGEND
        ap50 = result.per_class_ap50[k] if len(result.per_class_ap50) > k else np.nan
        ax.plot(recall, np.clip(curves[k], 0, 1), linewidth=1, color=_rgb(k) if few else "grey",
                label=f"{_class_label(names, k)} {ap50:.3f}" if few else None)
    if valid:
        mean = np.clip(curves[valid], 0, 1).mean(0)
        ax.plot(recall, mean, linewidth=3, color="#1f4e9c", label=f"all classes {result.map50:.3f} mAP@0.5")
    _unit_axes(ax, "Recall", "Precision", "Precision-Recall curve (IoU 0.5)")
    if valid:
        ax.legend(loc="lower left", fontsize=8)
    return _save(fig, path)


def confidence_curve_plot(result: Any, names: Sequence[str], path: str | Path, which: str = "F1") -> Path:
    """``which`` ("F1", "Precision" or "Recall") against confidence: each class thin, the mean bold
    with its best value and confidence in the legend."""
    curves = {"F1": result.conf_f1, "Precision": result.conf_precision, "Recall": result.conf_recall}[which]
    x = np.asarray(result.conf_points, float)
    fig = _figure(7, 6)
    ax = fig.subplots()
    valid = [k for k in range(len(curves)) if k < len(result.class_instances) and result.class_instances[k] > 0]
    for k in valid:
        few = len(valid) <= MAX_LEGEND
        ax.plot(x, curves[k], linewidth=1, color=_rgb(k) if few else "grey",
                label=_class_label(names, k) if few else None)
    if valid:
        mean = np.asarray(curves)[valid].mean(0)
        best = int(np.argmax(mean)) if which == "F1" else int(np.argmin(np.abs(x - result.best_conf)))
        ax.plot(x, mean, linewidth=3, color="#1f4e9c",
                label=f"all classes {mean[best]:.2f} at {x[best]:.3f}")
        ax.legend(loc="lower left" if which != "Recall" else "upper right", fontsize=8)
    _unit_axes(ax, "Confidence", which, f"{which}-Confidence curve (IoU 0.5)")
    return _save(fig, path)


def _unit_axes(ax: Any, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.4)


def confusion_matrix_plot(matrix: np.ndarray, names: Sequence[str], path: str | Path, *,
                          normalize: bool = True) -> Path:
    """The confusion matrix as a heat map: rows predicted, columns true, background last;
    normalized, each column (true class) sums to 1."""
    m = np.asarray(matrix, float)
    if normalize:
        m = m / np.maximum(m.sum(0, keepdims=True), 1e-9)
        m[m < 0.005] = np.nan  # empty cells blank
    labels = [_class_label(names, k) for k in range(len(m) - 1)] + ["background"]
    side = min(4 + 0.45 * len(labels), 24)
    fig = _figure(side + 1.5, side)
    ax = fig.subplots()
    image = ax.imshow(m, cmap="Blues", vmin=0, vmax=1 if normalize else None)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.02)
    if len(labels) <= 30:
        ax.set_xticks(range(len(labels)), labels, rotation=90)
        ax.set_yticks(range(len(labels)), labels)
        for (i, j), v in np.ndenumerate(m):
            if np.isfinite(v):
                colour = "white" if v > 0.5 * (1.0 if normalize else np.nanmax(m)) else "black"
                ax.text(j, i, f"{v:.2f}" if normalize else f"{int(v)}", ha="center", va="center",
                        fontsize=8, color=colour)
    ax.set_xlabel("True")
    ax.set_ylabel("Predicted")
    ax.set_title("Confusion matrix" + (" (normalized per true class)" if normalize else ""))
    return _save(fig, path)


def samples_plot(samples: Sequence[tuple[np.ndarray, Detections, Detections]], names: Sequence[str],
                 path: str | Path, *, pairs: int = 8, min_score: float = SAMPLE_MIN_SCORE) -> Path:
    """Validation images: ground truth on the left, predictions scoring at least ``min_score``
    on the right, two pairs a row; a segmentation model's masks filled on both (validation keeps the masks
    of predictions at ``SAMPLE_MIN_SCORE`` or more: a lower ``min_score`` shows no more of them)."""
    samples = list(samples)[:pairs]
    rows = max(1, math.ceil(len(samples) / 2))
    aspect = float(np.median([im.shape[0] / im.shape[1] for im, *_ in samples])) if samples else 1.0
    fig = _figure(13, rows * (13 / 4 * aspect + 0.35))
    axes = np.atleast_1d(fig.subplots(rows, 4)).reshape(-1)
    for ax in axes:
        ax.axis("off")
    for i, (image, pred, truth) in enumerate(samples):
        keep = np.asarray(pred.numpy().scores) >= min_score
        d = pred.numpy()
        shown = Detections(d.boxes[keep], d.scores[keep], d.labels[keep], None if d.masks is None else d.masks[keep])
        width = max(2, round(max(image.shape[:2]) / 250))
        for ax, drawn, title in ((axes[2 * i], draw_detections(image, truth, names, thickness=width,
                                                                show_scores=False), "labels"),
                                 (axes[2 * i + 1], draw_detections(image, shown, names, thickness=width),
                                  f"predictions (score >= {min_score:g})")):
            ax.imshow(drawn)
            ax.set_title(title, fontsize=9)
    return _save(fig, path)


def validation_plots(result: Any, samples: Sequence[Any], names: Sequence[str], out: str | Path) -> list[Path]:
    """Every chart of a validation into ``out``: PR, F1, P and R curves, the confusion matrix
    (normalized and counts) and, when there are samples, labels vs predictions."""
    out = Path(out)
    paths = [pr_curve_plot(result, names, out / "pr_curve.png")]
    paths += [confidence_curve_plot(result, names, out / f"{w.lower()}_curve.png", w)
              for w in ("F1", "Precision", "Recall")]
    paths.append(confusion_matrix_plot(result.confusion, names, out / "confusion_matrix_normalized.png"))
    paths.append(confusion_matrix_plot(result.confusion, names, out / "confusion_matrix.png", normalize=False))
    if samples:
        paths.append(samples_plot(samples, names, out / "val_predictions.jpg"))
    return paths
