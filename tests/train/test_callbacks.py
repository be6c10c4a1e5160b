import csv

import cv2
import numpy as np
import torch

from yolokit.ops.nms import Detections
from yolokit.train.callbacks import CSVLogger, Plotter, ProgressBar
from yolokit.train.evaluate import EvalResult
from yolokit.train.plots import draw_grid, line_plots


def test_csv_logger_appends_rows_under_one_header(tmp_path):
    log = CSVLogger(tmp_path / "results.csv")
    log.on_epoch_end({"epoch": 1, "train/box": 1.5, "mAP50": 0.25})
    log.on_epoch_end({"epoch": 2, "train/box": 1.25, "mAP50": 0.5})
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [r["epoch"] for r in rows] == ["1", "2"] and rows[1]["train/box"] == "1.25"


def test_progress_bar_reports_means(capsys):
    bar = ProgressBar()
    bar.on_epoch_start(0, 3, 2)
    bar.on_batch_end({"box": 1.0}, 8, 0.0)
    bar.on_batch_end({"box": 3.0}, 8, 0.0)
    assert bar.sums["box"] / bar.count == 2.0 and bar.images == 16
    bar.on_epoch_end({"epoch": 1, "precision": 0.5, "recall": 0.5, "mAP50": 0.4, "mAP50-95": 0.2})
    assert "mAP50 0.400" in capsys.readouterr().out


def test_line_plot_draws_the_series(tmp_path):
    path = line_plots([1, 2, 3], {"loss": [3.0, 2.0, 1.0]}, tmp_path / "l.png", "t")
    image = cv2.imread(str(path))
    assert image.shape == (300, 800, 3)
    coloured = (np.abs(image.astype(int) - image.mean(-1, keepdims=True)) > 40).any(-1)
    ys, xs = np.nonzero(coloured[:, :400])
    # a falling line: its leftmost coloured pixels sit higher than its rightmost
    assert ys[xs == xs.min()].mean() < ys[xs == xs.max()].mean()


def test_plotter_writes_all_pngs(tmp_path):
    plotter = Plotter(tmp_path)
    for e in (1, 2):
        plotter.on_epoch_end({"epoch": e, "train/box": 2.0 / e, "train/cls": 1.0, "precision": 0.5,
                              "recall": 0.4, "mAP50": 0.3 * e, "mAP50-95": 0.1 * e})
    r = np.linspace(0, 1, 101)
    result = EvalResult(pr_recall=r, pr_precision=np.stack([1 - r, -np.ones(101)]))
    det = Detections(torch.tensor([[5.0, 5.0, 40.0, 40.0]]), torch.tensor([0.9]), torch.tensor([0]))
    plotter.on_validation_end(result, [(np.zeros((64, 64, 3), np.uint8), det)] * 5, ["a", "b"])
    plotter.on_train_end()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["losses.png", "metrics.png", "pr_curve.png", "val_predictions.jpg"]
    grid = cv2.imread(str(tmp_path / "val_predictions.jpg"))
    assert grid.shape == (2 * 256, 4 * 256, 3)


def test_draw_grid_single_image(tmp_path):
    det = Detections(torch.zeros(0, 4), torch.zeros(0), torch.zeros(0, dtype=torch.long))
    path = draw_grid([(np.full((100, 50, 3), 255, np.uint8), det)], [], tmp_path / "g.png")
    image = cv2.imread(str(path))
    assert image.shape == (256, 256, 3) and (image[:, :128] == 255).all() and (image[:, 200:] == 114).all()


def test_draw_grid_hides_low_scores(tmp_path):
    from yolokit.viz import class_colour

    det = Detections(torch.tensor([[4.0, 4.0, 30.0, 30.0], [36.0, 36.0, 60.0, 60.0]]), torch.tensor([0.9, 0.01]),
                     torch.tensor([0, 1]))
    image = cv2.imread(str(draw_grid([(np.zeros((64, 64, 3), np.uint8), det)], ["a", "b"], tmp_path / "g.png",
                                     tile=64)))[..., ::-1]
    is_colour = lambda c: (np.abs(image.astype(int) - c).sum(-1) < 30)
    assert is_colour(class_colour(0)).sum() > 20 and is_colour(class_colour(1)).sum() == 0
