"""``yolokit export``, ``yolokit benchmark``, and ``predict`` / ``val`` on exported files, as a user runs
them (``yolokit.cli.main`` in this process: the exit code and the lines are the point, not a new
interpreter); bad input ends in one line and exit code 2."""

import re

import pytest
import torch
from _models import TINY, lively

import yolokit
from yolokit.cli import main
from yolokit.data import make_shapes

pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A small shapes set, a tiny detector's weights file (4 classes, lively weights) and its ONNX export."""
    root = tmp_path_factory.mktemp("deploy")
    data = make_shapes(root / "shapes", n_train=8, n_val=6, imgsz=64)
    torch.manual_seed(0)
    weights = root / "tiny.pt"
    yolokit.save(lively(yolokit.create_model(TINY, num_classes=4)), weights)
    assert main(["export", "--weights", str(weights), "--imgsz", "64", "--out", str(root / "tiny.onnx")]) == 0
    return root, data, weights, root / "tiny.onnx"


def table(text):
    """The per-class table's rows (class, images, instances, P, R, mAP50, mAP50-95) as printed."""
    return [line.split() for line in text.splitlines() if re.match(r"^\s+\w+\s+\d+\s+\d+\s+[\d.]+", line)]


def test_val_of_the_export_prints_the_weights_table(setup, capsys, tmp_path):
    root, data, weights, onnx = setup
    capsys.readouterr()
    runs = {}
    for name, file in (("weights", weights), ("onnx", onnx)):
        assert main(["val", "--weights", str(file), "--data", str(data), "--imgsz", "64", "--workers", "0",
                     "--no-plots", "--out", str(tmp_path / name)]) == 0
        runs[name] = capsys.readouterr().out
    assert len(table(runs["onnx"])) == 5 and table(runs["onnx"]) == table(runs["weights"])
    assert "6 images in" in runs["onnx"] and "on cpu" in runs["onnx"]


def test_predict_with_the_export_finds_what_the_weights_find(setup, capsys, tmp_path):
    root, data, weights, onnx = setup
    images = str(data.parent / "images" / "val")
    capsys.readouterr()
    said = {}
    for name, file in (("weights", weights), ("onnx", onnx)):
        assert main(["predict", images, "--weights", str(file), "--imgsz", "64", "--conf", "0.3",
                     "--out", str(tmp_path / name)]) == 0
        said[name] = [line for line in capsys.readouterr().out.splitlines() if ".jpg:" in line]
    assert len(said["onnx"]) == 6 and said["onnx"] == said["weights"]
    assert any("no detections" not in line for line in said["onnx"])
    assert (tmp_path / "onnx").is_dir() and len(list((tmp_path / "onnx").glob("*.jpg"))) == 6


def one_line_error(capsys, argv, *expected):
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    for text in expected:
        assert text in err, err
    return err


def test_bad_input_is_one_line_and_exit_2(setup, capsys, tmp_path, monkeypatch):
    root, data, weights, onnx = setup
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(onnx.read_bytes()[:1000])
    foreign = tmp_path / "notes.pt2"
    foreign.write_text("hello")
    image = str(data.parent / "images" / "val")
    one_line_error(capsys, ["predict", image, "--weights", str(cut)], "yolokit predict: error:", "cut.onnx",
                   "export it again")
    one_line_error(capsys, ["val", "--weights", str(foreign), "--data", str(data)], "notes.pt2: not a .pt2 package")
    one_line_error(capsys, ["export", "--weights", str(onnx), "--format", "openvino"], "already an exported file")
    one_line_error(capsys, ["export", "--weights", str(weights), "--int8"], "int8 is the OpenVINO format's")
    one_line_error(capsys, ["predict", image, "--weights", str(onnx), "--half", "--device", "cpu"], "--half")
    fixed = tmp_path / "fixed.onnx"
    assert main(["export", "--weights", str(weights), "--imgsz", "64", "--static", "--out", str(fixed)]) == 0
    one_line_error(capsys, ["predict", image, "--weights", str(fixed), "--imgsz", "96"],
                   "fixed.onnx was exported for 64x64 input", "--imgsz 64")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openvino" else real(name, *a))
    one_line_error(capsys, ["export", "--weights", str(weights), "--format", "openvino"],
                   "pip install 'yolokit[openvino]'")


def test_benchmark_prints_a_row_per_format(setup, capsys):
    root, data, weights, onnx = setup
    capsys.readouterr()
    assert main(["benchmark", "--weights", str(weights), "--data", str(data), "--imgsz", "64", "--batch", "4",
                 "--repeats", "3", "--formats", "eager,eager fused,onnx"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0] + (" fused" if "fused" in line else ""): line.split()
            for line in out.splitlines() if line.startswith(("eager", "onnx"))}
    assert set(rows) == {"eager", "eager fused", "onnx"}, out
    eager, onnx_row = rows["eager"], rows["onnx"]
    assert eager[1] == "-" and float(onnx_row[1]) > 0 and float(onnx_row[2]) > 0    # size, export time
    assert abs(float(onnx_row[3]) - float(eager[3])) <= 0.002                       # mAP50-95
    assert all(float(v) > 0 for v in onnx_row[4:6])                                 # latency, images/s


FAMILIES = [("yolov3-tiny", None), ("yolo26n.yaml", True), ("yolo26n.yaml", False), ("yolo11n.yaml", None)]


@pytest.mark.extended   # a yolov8-style tiny network runs by default (above); one export and two validations each
@pytest.mark.parametrize("name, end_to_end", FAMILIES, ids=[f"{n}-{e}" for n, e in FAMILIES])
def test_each_family_validates_through_onnx_as_its_weights_do(setup, capsys, tmp_path, name, end_to_end):
    """yolov3-tiny (anchors), yolo26n (both branches) and a YOLO11 YAML: the exported file's per-class table
    equals the weights' on the same data (multi-label NMS, or the one-to-one top-k with --no-nms)."""
    _, data, _, _ = setup
    torch.manual_seed(0)
    weights = tmp_path / "model.pt"
    yolokit.save(lively(yolokit.create_model(name, num_classes=4)), weights)
    flags = {True: ["--end-to-end"], False: ["--no-end-to-end"], None: []}[end_to_end]
    assert main(["export", "--weights", str(weights), "--imgsz", "64", "--out", str(tmp_path / "m.onnx"), *flags]) == 0
    nms = ["--no-nms"] if end_to_end else []
    tables = []
    for file in (weights, tmp_path / "m.onnx"):
        capsys.readouterr()
        assert main(["val", "--weights", str(file), "--data", str(data), "--imgsz", "64", "--workers", "0",
                     "--no-plots", "--out", str(tmp_path / file.suffix[1:]), *nms]) == 0
        tables.append(table(capsys.readouterr().out))
    assert len(tables[1]) == 5 and tables[1] == tables[0]
