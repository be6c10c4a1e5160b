"""yolokit.viz: detections drawn on images, a run's curves as a figure."""

import csv

import cv2
import numpy as np
import pytest
import torch

from yolokit.ops.nms import Detections
from yolokit.viz import class_colour, draw_detections, epoch_rows, run_curves, smooth


def test_draws_box_in_class_colour_and_caption_without_touching_input():
    image = np.zeros((100, 120, 3), dtype=np.uint8)
    det = Detections(torch.tensor([[20.0, 40.0, 80.0, 90.0]]), torch.tensor([0.9]), torch.tensor([3]))
    out = draw_detections(image, det, ["a", "b", "c", "dog"], thickness=1)
    assert image.max() == 0 and out.shape == image.shape
    colour = class_colour(3)
    assert tuple(out[60, 20]) == colour and tuple(out[90, 50]) == colour  # left edge, bottom edge
    assert tuple(out[65, 50]) == (0, 0, 0)  # inside stays untouched
    caption = out[20:40, 20:80]
    assert (caption == colour).all(axis=-1).sum() > 50  # caption background sits above the box


def test_names_mapping_and_numpy_detections():
    image = np.full((50, 50, 3), 255, dtype=np.uint8)
    det = Detections(np.array([[5.0, 20.0, 45.0, 45.0]]), np.array([0.5]), np.array([0]))
    out = draw_detections(image, det, {0: "x"})
    assert (out != 255).any()


def test_rejects_wrong_image():
    det = Detections(torch.zeros(0, 4), torch.zeros(0), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="uint8 RGB"):
        draw_detections(np.zeros((10, 10), np.uint8), det)


def test_smooth_keeps_ends_and_nans():
    y = np.array([1.0, 1.0, 1.0, np.nan, 1.0, 1.0])
    np.testing.assert_allclose(smooth(y)[[0, 1, 2, 4, 5]], 1.0)  # a constant stays constant, ends included
    assert np.isnan(smooth(y)[3])
    noisy = np.array([0.0, 1.0] * 10)
    assert smooth(noisy).std() < 0.2 * noisy.std()


def write_results(folder, rows):
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return folder


def test_run_curves_draws_a_panel_per_quantity_from_the_csv(tmp_path):
    from matplotlib.figure import Figure

    rows = [{"epoch": e, "train/box": 2 / e, "train/cls": 1 / e, "precision": "" if e == 2 else 0.1 * e,
             "mAP50": 0.05 * e, "lr": 0.01, "seconds": 30} for e in range(1, 6)]  # precision not read at epoch 2
    run = write_results(tmp_path / "run", rows)
    read = epoch_rows(run)
    assert read == epoch_rows(run / "results.csv") and "precision" not in read[1] and read[4]["mAP50"] == 0.25
    fig = run_curves(run)
    assert isinstance(fig, Figure) and tuple(fig.get_size_inches()) == (3.6 * 4, 2.9)    # made outside pyplot
    png = cv2.imdecode(np.frombuffer(fig._repr_png_(), np.uint8), cv2.IMREAD_COLOR)   # a notebook shows it, pyplot
    assert png.shape == (290, 1440, 3)                                                # or not
    assert [ax.get_title() for ax in fig.axes] == ["train/box", "train/cls", "precision", "mAP50"]  # not lr
    for ax, key in zip(fig.axes, ["train/box", "train/cls", "precision", "mAP50"], strict=True):
        raw, smoothed = ax.get_lines()
        expected = [float(r[key]) if r[key] != "" else np.nan for r in rows]
        np.testing.assert_array_equal(raw.get_xdata(), [1, 2, 3, 4, 5])
        np.testing.assert_allclose(raw.get_ydata(), expected, rtol=1e-6)      # the CSV's values, NaN kept
        np.testing.assert_allclose(smoothed.get_ydata(), smooth(expected))
    two = run_curves(read[:2])                                             # rows work as well as a folder
    assert len(two.axes) == 4 and all(len(ax.get_lines()) == 1 for ax in two.axes)  # no smoothing under 3 points
    with pytest.raises(ValueError, match="no epoch row"):
        run_curves([{"epoch": 1, "lr": 0.01}])
