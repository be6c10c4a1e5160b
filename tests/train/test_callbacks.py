import csv

import cv2
import numpy as np
import pytest
import torch

from yolokit.ops.nms import Detections
from yolokit.train.callbacks import CSVLogger, Plotter, ProgressBar
from yolokit.train.plots import results_plot, validation_plots
from yolokit.val.metrics import EvalResult
from yolokit.viz import class_colour


def test_csv_logger_appends_rows_under_one_header(tmp_path):
    log = CSVLogger(tmp_path / "results.csv")
    log.on_epoch_end({"epoch": 1, "train/box": 1.5, "mAP50": 0.25})
    log.on_epoch_end({"epoch": 2, "train/box": 1.25, "mAP50": 0.5})
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [r["epoch"] for r in rows] == ["1", "2"] and rows[1]["train/box"] == "1.25"
    # a resumed run's logger keeps the file's columns: a missing key leaves its cell empty, in place
    resumed = CSVLogger(tmp_path / "results.csv")
    resumed.write({"mAP50": 0.75, "epoch": 3, "extra": 1.0})
    lines = (tmp_path / "results.csv").read_text().splitlines()
    assert lines[0] == "epoch,train/box,mAP50" and lines[-1] == "3,,0.75"


def test_progress_bar_shows_the_running_means_then_the_epoch_row(capsys):
    """The bar shows the meter's running means as given (not a mean of means), the data share and
    memory; at the epoch's end the results row's losses, which are what results.csv holds."""
    bar = ProgressBar()
    bar.on_epoch_start(0, 3, 2)
    bar.on_batch_end({"box": 1.0}, 8, 0.5, 0.25)
    assert bar.postfix["box"] == "1.000" and bar.postfix["data"] == "25%" and bar.postfix["mem"] == "0.50G"
    bar.on_batch_end({"box": 3.0}, 8, 0.5, 0.125)
    assert bar.postfix["box"] == "3.000" and bar.postfix["data"] == "12%" and bar.images == 16
    bar.on_epoch_end({"epoch": 1, "train/box": 2.5, "data%": 40.0, "precision": 0.5, "recall": 0.5, "mAP50": 0.4,
                      "mAP50-95": 0.2})
    assert bar.postfix["box"] == "2.500" and bar.postfix["data"] == "40%"
    captured = capsys.readouterr()
    assert "mAP50 0.400" in captured.out and "box=2.500" in captured.err


SUMMARY = dict(model="yolov8n", data="shapes", classes=4, world=1, device="cpu", batch=8, per_process=8,
               accumulate=8, step_batch=64, optimizer="adamw", lr0=0.00125, precision="fp32", layout="nchw",
               sync_bn=False, workers=2, threads=1, config="model: yolov8n\n" * 80, config_file="runs/a/config.yaml",
               changed="epochs=2, imgsz=64", notes=["resuming at epoch 2"], shard_cache=False)
ROW = {"epoch": 1, "train/box": 2.5, "train/cls": 1.25, "data%": 40.0, "precision": 0.5, "recall": 0.25,
       "mAP50": 0.4, "mAP50-95": 0.2, "seconds": 12.34}


def _epoch(bar, batches=30, row=ROW):
    bar.on_setup_end(SUMMARY)
    bar.on_train_start("runs/a", {})
    bar.on_epoch_start(0, 2, batches)
    for _ in range(batches):
        bar.on_batch_end({"box": 1.0, "cls": 2.0}, 8, 0.5, 0.25)
    bar.on_epoch_end(row)


def test_the_header_is_two_lines_and_names_the_config_file(capsys):
    """The run's YAML is in its folder: the console names the file and the fields set, in one line."""
    _epoch(ProgressBar(notebook=False), batches=2)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("yolokit train: yolov8n on shapes (4 classes)")
    assert out[0].endswith("2 loader workers and 1 torch thread per process")   # a CPU run's speed and sums
    assert out[1:3] == ["config: runs/a/config.yaml (epochs=2, imgsz=64)", "resuming at epoch 2"]
    assert "model: yolov8n" not in "\n".join(out)


def test_quiet_prints_one_line_per_epoch_and_the_final_metrics(capsys):
    bar = ProgressBar(verbose=False, notebook=False)
    _epoch(bar)
    bar.on_export("runs/a/weights/model.pt")
    bar.on_train_end()
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [
        "epoch 1/2: box 2.500 cls 1.250  P 0.500  R 0.250  mAP50 0.400  mAP50-95 0.200  12.3 s",
        "results in runs/a: P 0.500  R 0.250  mAP50 0.400  mAP50-95 0.200"]
    assert captured.err == ""                                  # no bar


def test_in_a_notebook_the_text_bar_is_on_stdout_and_redraws_at_most_once_a_second(capsys, monkeypatch):
    """Without ipywidgets the notebook's bar is text; each redraw is kept in the notebook, so they are few:
    30 batches in well under a second draw the bar's start, its end and the epoch's row, nothing between."""
    from tqdm import tqdm

    from yolokit.train import callbacks

    monkeypatch.setattr(callbacks, "notebook_bar_class", lambda: tqdm)
    bar = ProgressBar(notebook=True)
    _epoch(bar)
    bar.on_interrupt(5, "runs/a")                              # the exception's one line says it instead
    captured = capsys.readouterr()
    assert captured.err == "" and "interrupted" not in captured.out
    draws = captured.out.count("epoch 1/2:")
    assert 2 <= draws <= 4, captured.out
    assert len(captured.out) < 1500 and "box=2.500" in captured.out and "mAP50 0.400" in captured.out


def test_in_a_notebook_a_long_epoch_redraws_its_text_bar_about_ten_times(capsys, monkeypatch):
    """A slow epoch (each batch 2 s here, on a clock of the test's) draws about ten times, not once a second."""
    import tqdm.std

    from yolokit.train import callbacks

    clock = iter(range(0, 10**6, 2))
    monkeypatch.setattr(tqdm.std, "time", lambda: float(next(clock)))
    monkeypatch.setattr(callbacks, "notebook_bar_class", lambda: tqdm.std.tqdm)
    _epoch(ProgressBar(notebook=True), batches=300)
    draws = capsys.readouterr().out.count("epoch 1/2:")
    assert 10 <= draws <= 13, draws


def test_the_notebook_bar_is_the_widget_where_ipywidgets_is_installed():
    pytest.importorskip("ipywidgets")
    from tqdm.notebook import tqdm as widget

    from yolokit.train.callbacks import in_notebook, notebook_bar_class

    assert notebook_bar_class() is widget and not in_notebook()   # pytest is no kernel


def fake_result(num_classes=2):
    """An EvalResult as coco_evaluate fills it, for two classes."""
    r = np.linspace(0, 1, 101)
    x = np.linspace(0, 1, 1000)
    p_curve = np.stack([1 - 0.5 * x, 0.5 + 0 * x])
    r_curve = np.stack([1 - x, 0.8 * (1 - x)])
    return EvalResult(map50=0.7, map50_95=0.5, per_class_ap50=np.array([0.75, 0.6]),
                      pr_recall=r, pr_precision=np.stack([1 - r, np.full(101, 0.6)]), conf_points=x,
                      conf_precision=p_curve, conf_recall=r_curve, conf_f1=2 * p_curve * r_curve / (p_curve + r_curve),
                      class_instances=np.array([5, 3]), best_conf=0.3, confusion=np.array([[4, 1, 2], [0, 2, 1],
                                                                                            [1, 0, 0]]))


def ink(path):
    """Fraction of pixels that are not near-white."""
    image = cv2.imread(str(path))
    assert image is not None, path
    return (image.min(-1) < 200).mean(), image.shape


def test_results_plot_has_a_panel_per_quantity(tmp_path):
    rows = [{"epoch": e, "train/box": 2.0 / e, "train/cls": 1.0 / e, "train/dfl": 1.5, "precision": 0.1 * e,
             "recall": 0.1 * e, "mAP50": 0.05 * e, "mAP50-95": 0.03 * e, "lr": 0.01} for e in range(1, 8)]
    path = results_plot(rows, tmp_path / "results.png")
    share, shape = ink(path)
    assert shape == (580, 1440, 3) and 0.03 < share < 0.5  # 2 rows x 4 panels of 360x290 px at 100 dpi
    assert results_plot([], tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()
    assert results_plot([{"epoch": 1, "train/box": 1.0}], tmp_path / "one.png").is_file()  # a single point


def test_validation_charts(tmp_path):
    result = fake_result()
    truth = Detections(torch.tensor([[5.0, 5.0, 40.0, 40.0]]), torch.ones(1), torch.tensor([1]))
    det = Detections(torch.tensor([[5.0, 5.0, 40.0, 40.0], [1.0, 1.0, 3.0, 3.0]]), torch.tensor([0.9, 0.1]),
                     torch.tensor([1, 0]))
    paths = validation_plots(result, [(np.zeros((64, 48, 3), np.uint8), det, truth)] * 3, ["a", "b"], tmp_path)
    assert sorted(p.name for p in paths) == sorted([
        "pr_curve.png", "f1_curve.png", "precision_curve.png", "recall_curve.png", "confusion_matrix_normalized.png",
        "confusion_matrix.png", "val_predictions.jpg"])
    for path in paths:
        share, _ = ink(path)
        assert 0.01 < share < 0.9, path
    grid = cv2.imread(str(tmp_path / "val_predictions.jpg"))[..., ::-1]

    def is_colour(c):
        return (np.abs(grid.astype(int) - c).sum(-1) < 40).sum()

    assert is_colour(class_colour(1)) > 100 and is_colour(class_colour(0)) == 0  # the 0.1 score is hidden


def test_plotter_writes_every_chart_and_never_raises(tmp_path):
    plotter = Plotter(tmp_path)
    for e in (1, 2, 3):
        plotter.on_epoch_end({"epoch": e, "train/box": 2.0 / e, "train/cls": 1.0, "precision": 0.5, "recall": 0.4,
                              "mAP50": 0.3 * e, "mAP50-95": 0.1 * e})
    truth = Detections(torch.zeros(0, 4), torch.zeros(0), torch.zeros(0, dtype=torch.long))
    plotter.on_validation_end(fake_result(), [(np.zeros((64, 64, 3), np.uint8), truth, truth)], ["a", "b"])
    plotter.on_train_end()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([
        "results.png", "pr_curve.png", "f1_curve.png", "precision_curve.png", "recall_curve.png",
        "confusion_matrix_normalized.png", "confusion_matrix.png", "val_predictions.jpg"])
    broken = Plotter(tmp_path / "b")
    broken.on_epoch_end({"epoch": 1, "mAP50": 0.1})
    broken.on_validation_end(object(), [], [])  # not an EvalResult: the charts fail, the run goes on
    with pytest.warns(UserWarning, match="plots of .* not drawn"):
        broken.on_train_end()


def test_the_bar_of_a_failed_epoch_ends_its_line_before_the_error(capsys):
    """A run that stops mid-epoch (a store that stopped, a full disk) prints its one-line error after
    ``on_train_end``: the bar's line ends there, and nothing is drawn after it."""
    bar = ProgressBar()
    bar.on_epoch_start(0, 3, 5)
    bar.on_batch_end({"box": 1.0}, 8, 0.5, 0.25)
    assert not capsys.readouterr().err.endswith("\n")     # the bar's line, open
    bar.on_train_end()
    assert capsys.readouterr().err.endswith("\n")
    bar.on_train_end()                                    # closing twice draws nothing
    assert capsys.readouterr().err == ""


def test_the_resume_note_warns_of_the_mosaic_buffer_only_while_mosaic_is_on():
    from types import SimpleNamespace

    from yolokit.data import AugmentConfig
    from yolokit.train.build import resume_note

    def note(epoch, epochs=20, close_mosaic=10, mosaic=1.0, buffer=64, rect=False):
        data = SimpleNamespace(augment=True, rect=rect, hyp=AugmentConfig(mosaic=mosaic), buffer_size=buffer)
        parts = SimpleNamespace(train_set=data, config=SimpleNamespace(epochs=epochs, close_mosaic=close_mosaic))
        return resume_note(parts, SimpleNamespace(epoch=epoch, step_in_epoch=3))

    assert "mosaic_buffer > 0" in note(3)
    assert note(0, epochs=2) == "resuming at optimizer step 3 of epoch 1"   # close_mosaic covers the whole run
    assert "mosaic_buffer" not in note(12)                                   # Mosaic closed by then
    assert "mosaic_buffer" not in note(3, mosaic=0.0) and "mosaic_buffer" not in note(3, buffer=0)
    assert "mosaic_buffer" not in note(3, rect=True)
