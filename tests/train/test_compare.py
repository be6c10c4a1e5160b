"""compare_runs / yolokit compare: two run folders side by side, from results.csv and config.yaml."""

import csv

import pytest

from yolokit.cli import main
from yolokit.train import TrainConfig, compare_runs


def fake_run(folder, config, fitness_and_maps):
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(config.to_yaml())
    with (folder / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["epoch", "train/box", "mAP50", "mAP50-95", "fitness", "seconds",
                                               "data%"])
        writer.writeheader()
        for epoch, (m50, m5095) in enumerate(fitness_and_maps, 1):
            writer.writerow({"epoch": epoch, "train/box": 1.0 / epoch, "mAP50": m50, "mAP50-95": m5095,
                             "fitness": 0.1 * m50 + 0.9 * m5095, "seconds": 1800, "data%": 3.0})
    return folder


def test_the_best_epoch_the_last_and_every_differing_field(tmp_path):
    base = TrainConfig(model="yolov8s", data="d.yaml", epochs=4, lr0=0.01)
    a = fake_run(tmp_path / "frozen", base.replace(freeze=10, out="runs/a"), [(0.5, 0.3), (0.7, 0.4), (0.6, 0.35)])
    b = fake_run(tmp_path / "all", base.replace(lr0=0.02, mosaic=0.5, out="runs/b"), [(0.2, 0.1), (0.9, 0.38)])
    got = compare_runs([a, b])
    assert [(r["epochs"], r["epochs_asked"], r["best_epoch"]) for r in got.rows] == [(3, 4, 2), (2, 4, 2)]
    assert [(r["mAP50-95"], r["mAP50"], r["last_mAP50-95"]) for r in got.rows] == [(0.4, 0.7, 0.35),
                                                                                   (0.38, 0.9, 0.38)]
    assert [r["hours"] for r in got.rows] == pytest.approx([1.5, 1.0], rel=1e-12)
    assert got.differences == {"freeze": [10, None], "lr0": [0.01, 0.02], "mosaic": [1.0, 0.5]}  # not `out`
    text = str(got).splitlines()
    assert text[0].split() == ["run", "model", "epochs", "best", "mAP50-95", "mAP50", "last", "mAP50-95", "time"]
    assert text[1].split() == [str(a), "yolov8s", "3/4", "2", "0.4000", "0.7000", "0.3500", "1.50h"]
    assert text[-1] == "differs: freeze 10 vs None; lr0 0.01 vs 0.02; mosaic 1.0 vs 0.5"


def test_yolokit_compare_prints_the_table_and_names_a_folder_that_is_no_run(tmp_path, capsys):
    a = fake_run(tmp_path / "a", TrainConfig(), [(0.5, 0.3)])
    assert main(["compare", str(a), str(a)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and out[-1] == "the configs are the same"
    (tmp_path / "empty").mkdir()
    assert main(["compare", str(a), str(tmp_path / "empty")]) == 2
    assert f"{tmp_path / 'empty'} is not a training run folder with an epoch done: config.yaml is missing" in \
        capsys.readouterr().err
