"""compare_runs / yolokit compare: two run folders side by side, from results.csv and config.yaml; one run's
results (read_results), printed, as HTML and as curves."""

import csv

import numpy as np
import pytest

from yolokit.cli import main
from yolokit.train import RunResults, TrainConfig, compare_runs, read_results


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


def test_a_comparison_shows_as_its_text_and_as_html_tables(tmp_path):
    base = TrainConfig(model="yolov8s", data="d.yaml", epochs=4)
    a = fake_run(tmp_path / "a", base.replace(freeze=10), [(0.5, 0.3), (0.7, 0.4)])
    b = fake_run(tmp_path / "<b>", base.replace(lr0=0.02), [(0.2, 0.1)])
    got = compare_runs([a, b])
    assert repr(got) == str(got) and len(repr(got).splitlines()) == 4     # the short table, not the dataclass's
    page = got._repr_html_()
    assert page.count("<table>") == 2 and "<th>last mAP50-95</th><th>time</th>" in page
    assert f"<tr><td>{a}</td><td>yolov8s</td><td>2/4</td><td>2</td><td>0.4000</td><td>0.7000</td><td>0.4000</td>" \
           "<td>1.00h</td></tr>" in page
    assert f"<th>differs</th><th>{a}</th><th>{tmp_path}/&lt;b&gt;</th>" in page and "<b>" not in page
    assert "<tr><td>freeze</td><td>10</td><td>None</td></tr><tr><td>lr0</td><td>0.01</td><td>0.02</td></tr>" in page
    assert compare_runs([a, a])._repr_html_().endswith("</table><p>the configs are the same</p>")


def test_read_results_holds_a_run_and_shows_it_short_as_a_table_and_as_curves(tmp_path):
    run = fake_run(tmp_path / "run", TrainConfig(epochs=10), [(0.5, 0.3), (0.7, 0.4), (0.6, 0.35)])
    got = read_results(run)
    assert isinstance(got, RunResults) and got.run_dir == run and got.config["epochs"] == 10
    assert [r["mAP50-95"] for r in got.rows] == [0.3, 0.4, 0.35] and got.best["epoch"] == 2
    assert repr(got) == f"RunResults('{run}', 3/10 epochs, best epoch 2 mAP50-95 0.4000)"
    page = got._repr_html_()
    assert page.startswith(f"<p>RunResults(&#x27;{run}&#x27;, 3/10 epochs")
    assert "<tr><th>epoch</th><th>train/box</th><th>mAP50</th><th>mAP50-95</th><th>seconds</th></tr>" in page
    assert "<tr><td>2</td><td>0.5000</td><td>0.7000</td><td>0.4000</td><td>1800.0</td></tr>" in page  # no data%
    assert page.count("<tr>") == 4
    fig = got.plot()
    assert [ax.get_title() for ax in fig.axes] == ["train/box", "mAP50", "mAP50-95"]
    np.testing.assert_allclose(fig.axes[2].get_lines()[0].get_ydata(), [0.3, 0.4, 0.35])
