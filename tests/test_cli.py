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
