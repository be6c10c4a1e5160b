import json
import subprocess
import sys

import numpy as np
from PIL import Image

from yolokit.cli import main


def test_demo_prints_detections_and_summary(tmp_path, capsys):
    assert main(["demo", "--model", "yolov3-tiny", "--imgsz", "64", "--images", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("Detections(n=5)") == 2
    assert "yolov3-tiny summary:" in out and "8,852,366 parameters" in out  # 80 classes by default
    records = json.loads((tmp_path / "detections.json").read_text())
    assert len(records) == 2 and len(records[0]["detections"]) == 5
    assert (tmp_path / "demo0.jpg").is_file()


def test_predict_writes_drawn_images_and_json(tmp_path, capsys):
    src = tmp_path / "in"
    src.mkdir()
    for i in range(2):
        Image.fromarray(np.full((40, 70, 3), 60 * i, np.uint8)).save(src / f"p{i}.png")
    out = tmp_path / "out"
    code = main(["predict", str(src), "--model", "yolov8n", "--imgsz", "64", "--conf", "0", "--max-det", "3",
                 "--out", str(out)])
    assert code == 0
    records = json.loads((out / "detections.json").read_text())
    assert [r["image"] for r in records] == [str(src / "p0.png"), str(src / "p1.png")]
    for r in records:
        assert 0 < len(r["detections"]) <= 3
        for d in r["detections"]:
            x1, y1, x2, y2 = d["box"]
            assert 0 <= x1 <= x2 <= 70 and 0 <= y1 <= y2 <= 40
    assert (out / "p0.jpg").is_file() and (out / "p1.jpg").is_file()


def test_missing_source_is_a_clear_error(tmp_path, capsys):
    assert main(["predict", str(tmp_path / "nope.jpg"), "--imgsz", "64"]) == 2
    assert "nope.jpg" in capsys.readouterr().err


def test_console_script_help():
    result = subprocess.run([sys.executable, "-m", "yolokit.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "demo" in result.stdout and "predict" in result.stdout


def test_train_val_predict_export_on_a_tiny_set(tmp_path, capsys):
    import pytest

    from yolokit.data import make_shapes

    data = str(make_shapes(tmp_path / "shapes", n_train=8, n_val=4, imgsz=64))
    run = tmp_path / "run"
    assert main(["train", "--data", data, "--epochs", "1", "--imgsz", "64", "--batch", "8", "--workers", "0",
                 "--out", str(run), "--no-plots"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["run_dir"] == str(run)
    weights = str(run / "weights" / "model.pt")
    assert main(["val", "--weights", weights, "--data", data, "--imgsz", "64", "--workers", "0"]) == 0
    out = capsys.readouterr().out
    assert "4 images: P" in out and "circle" in out and "star" in out
    pred = tmp_path / "pred"
    assert main(["predict", str(tmp_path / "shapes" / "images" / "val"), "--weights", weights, "--imgsz", "64",
                 "--conf", "0", "--max-det", "2", "--out", str(pred)]) == 0
    records = json.loads((pred / "detections.json").read_text())
    assert len(records) == 4 and all(d["name"] in ("circle", "rectangle", "triangle", "star")
                                     for r in records for d in r["detections"])
    pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    assert main(["export", "--weights", weights, "--imgsz", "64", "--out", str(tmp_path / "m.onnx")]) == 0
    assert (tmp_path / "m.onnx").stat().st_size > 1_000_000
    import onnx

    ops = {n.op_type for n in onnx.load(str(tmp_path / "m.onnx")).graph.node}
    assert "Conv" in ops and "BatchNormalization" not in ops  # exported fused


def test_train_errors_are_named(tmp_path, capsys):
    assert main(["train", "--model", "yolov9"]) == 2
    assert "yolov9" in capsys.readouterr().err
    assert main(["train", "--data", str(tmp_path / "nope.yaml"), "--epochs", "1"]) == 2
    assert "nope.yaml" in capsys.readouterr().err
