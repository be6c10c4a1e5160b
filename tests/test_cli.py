import contextlib
import csv
import io
import json
import subprocess
import sys

import cv2
import numpy as np
import pytest
import torch
from _models import TINY
from PIL import Image

from yolokit.cli import main, resolve_device
from yolokit.data import make_shapes


def test_demo_prints_detections_and_summary(tmp_path, capsys):
    assert main(["demo", "--model", "yolov3-tiny", "--imgsz", "64", "--images", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("Detections(n=5)") == 2
    assert "yolov3-tiny summary:" in out and "8,852,366 parameters" in out  # 80 classes by default
    records = json.loads((tmp_path / "predictions.json").read_text())
    assert len(records) == 10 and {r["image_id"] for r in records} == {"image0", "image1"}
    assert (tmp_path / "image0.jpg").is_file() and (tmp_path / "image1.jpg").is_file()


def write_tree(root):
    """Two folders holding a same-named image, one nested deeper, and a text file."""
    rng = np.random.default_rng(0)
    for rel in ("a/p.png", "b/p.png", "b/deep/q.jpg"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (40, 70, 3), dtype=np.uint8)).save(root / rel)
    (root / "a" / "notes.txt").write_text("not an image")


def test_predict_mirrors_the_source_tree_and_saves_every_output(tmp_path, capsys):
    COCO = pytest.importorskip("pycocotools.coco").COCO   # not on every machine (the GPU image)
    write_tree(tmp_path / "in")
    out = tmp_path / "out"
    code = main(["predict", str(tmp_path / "in"), "--model", "yolov8n", "--num-classes", "3", "--imgsz", "64",
                 "--conf", "0", "--max-det", "3", "--batch", "2", "--device", "cpu", "--save-txt", "--save-conf",
                 "--save-json", "--save-crop", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "3 images in" in printed and "on cpu" in printed
    for rel in ("a/p.png", "b/p.png", "b/deep/q.jpg"):  # same-named files of two folders both kept
        drawn = cv2.imread(str(out / rel))
        assert drawn is not None and drawn.shape == (40, 70, 3)
        labels = (out / "labels" / rel).with_suffix(".txt").read_text().splitlines()
        assert len(labels) == 3
        for line in labels:
            cls, cx, cy, w, h, conf = line.split()
            assert 0 <= int(cls) < 3 and all(0 <= float(v) <= 1 for v in (cx, cy, w, h)) and 0 <= float(conf) <= 1
    crops = sorted(p.relative_to(out / "crops") for p in (out / "crops").rglob("*.jpg"))
    assert len(crops) == 9 and all(p.parts[0] in ("0", "1", "2") for p in crops)
    records = json.loads((out / "predictions.json").read_text())
    assert len(records) == 9 and {r["image_id"] for r in records} == {"a/p", "b/p", "b/deep/q"}
    gt = COCO()  # pycocotools takes the file as detection results of a matching ground truth
    gt.dataset = {"images": [{"id": i} for i in ("a/p", "b/p", "b/deep/q")],
                  "categories": [{"id": c} for c in range(3)], "annotations": []}
    with contextlib.redirect_stdout(io.StringIO()):
        gt.createIndex()
        dt = gt.loadRes(str(out / "predictions.json"))
    assert len(dt.getAnnIds()) == 9


def write_video(path, frames=7, fps=12.0, size=(64, 48)):
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), fps, size)
    for i in range(frames):
        writer.write(np.full((size[1], size[0], 3), 30 * i, np.uint8))
    writer.release()
    return path


def test_predict_on_a_video_writes_an_annotated_video_at_its_frame_rate(tmp_path, capsys):
    video = write_video(tmp_path / "clip.avi")
    out = tmp_path / "out"
    assert main(["predict", str(video), "--num-classes", "2", "--imgsz", "64", "--conf", "0", "--max-det", "1",
                 "--batch", "4", "--save-txt", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "clip.avi frame 6: 64x48" in printed and "7 images in" in printed
    capture = cv2.VideoCapture(str(out / "clip.mp4"))
    assert capture.get(cv2.CAP_PROP_FPS) == pytest.approx(12.0)
    assert int(capture.get(cv2.CAP_PROP_FRAME_COUNT)) == 7
    assert (capture.get(cv2.CAP_PROP_FRAME_WIDTH), capture.get(cv2.CAP_PROP_FRAME_HEIGHT)) == (64, 48)
    capture.release()
    assert sorted(p.name for p in (out / "labels").iterdir()) == sorted(f"clip_{i}.txt" for i in range(7))


def test_default_run_folders_are_numbered_not_overwritten(tmp_path, monkeypatch, capsys):
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(tmp_path / "x.png")
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        assert main(["predict", "x.png", "--num-classes", "1", "--imgsz", "32", "--save-txt"]) == 0
    assert (tmp_path / "runs" / "predict" / "x.png").is_file() and (tmp_path / "runs" / "predict2" / "x.png").is_file()


def test_missing_source_and_bad_devices_are_clear_errors(tmp_path, capsys):
    assert main(["predict", str(tmp_path / "nope.jpg"), "--imgsz", "64", "--out", str(tmp_path / "o")]) == 2
    assert "nope.jpg" in capsys.readouterr().err
    assert main(["predict", str(tmp_path), "--device", "tpu", "--out", str(tmp_path / "o")]) == 2
    assert "unknown device 'tpu'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["val", "--device", "cuda:0", "--imgsz", "64"]) == 2
        assert "CUDA is not available" in capsys.readouterr().err
        assert main(["predict", str(tmp_path), "--half", "--device", "cpu", "--out", str(tmp_path / "o")]) == 2
        assert "--half needs a CUDA device" in capsys.readouterr().err
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_console_script_help(capsys):
    result = subprocess.run([sys.executable, "-m", "yolokit.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "demo" in result.stdout and "predict" in result.stdout
    with pytest.raises(SystemExit) as stop:          # a command's help, in this process: the same parser
        main(["val", "--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0 and "--device" in out and "--half" in out and "multi-label" in out


@pytest.mark.slow
def test_train_val_predict_export_on_a_tiny_set(tmp_path, capsys):
    from yolokit.data import make_shapes

    data = str(make_shapes(tmp_path / "shapes", n_train=8, n_val=4, imgsz=64))
    run = tmp_path / "run"
    assert main(["train", "--data", data, "--model", TINY, "--epochs", "1", "--imgsz", "64", "--batch", "8",
                 "--workers", "0", "--out", str(run), "--no-plots"]) == 0   # the commands' path, on a small net
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["run_dir"] == str(run)
    weights = str(run / "weights" / "model.pt")
    val_out = tmp_path / "val"
    assert main(["val", "--weights", weights, "--data", data, "--imgsz", "64", "--workers", "0", "--device", "cpu",
                 "--out", str(val_out)]) == 0
    out = capsys.readouterr().out
    assert "Class     Images  Instances" in out and "all" in out and "4 images in" in out
    rows = list(csv.DictReader((val_out / "per_class.csv").open()))
    assert rows[0]["class"] == "all" and rows[0]["images"] == "4"
    assert {r["class"] for r in rows[1:]} <= {"circle", "rectangle", "triangle", "star"}
    assert sum(int(r["instances"]) for r in rows[1:]) == int(rows[0]["instances"]) > 0
    for chart in ("pr_curve.png", "f1_curve.png", "confusion_matrix_normalized.png", "val_predictions.jpg"):
        assert cv2.imread(str(val_out / chart)) is not None
    pred = tmp_path / "pred"
    assert main(["predict", str(tmp_path / "shapes" / "images" / "val"), "--weights", weights, "--imgsz", "64",
                 "--conf", "0", "--max-det", "2", "--save-crop", "--out", str(pred)]) == 0
    assert {p.name for p in (pred / "crops").iterdir()} <= {"circle", "rectangle", "triangle", "star"}  # names
    pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    assert main(["export", "--weights", weights, "--imgsz", "64", "--device", "cpu",
                 "--out", str(tmp_path / "m.onnx")]) == 0
    assert (tmp_path / "m.onnx").stat().st_size > 500_000     # the tiny network's ~200k float32 weights
    import onnx

    model = onnx.load(str(tmp_path / "m.onnx"))
    ops = {n.op_type for n in model.graph.node}
    assert "Conv" in ops and "BatchNormalization" not in ops  # exported fused
    assert json.loads({p.key: p.value for p in model.metadata_props}["names"]) == ["circle", "rectangle",
                                                                                   "triangle", "star"]


def test_train_errors_are_named(tmp_path, capsys):
    assert main(["train", "--model", "yolov9"]) == 2
    assert "yolov9" in capsys.readouterr().err
    assert main(["train", "--data", str(tmp_path / "nope.yaml"), "--epochs", "1"]) == 2
    assert "nope.yaml" in capsys.readouterr().err


@pytest.mark.parametrize("resume", [None, "auto"])
def test_the_shapes_preset_applies_to_new_runs_and_resume_auto(monkeypatch, tmp_path, resume):
    from yolokit import cli

    seen = []
    monkeypatch.setattr(cli, "train", lambda config: seen.append(config) or {})
    argv = ["train", "--epochs", "2", "--out", str(tmp_path / "run")] + (["--resume", resume] if resume else [])
    assert cli.main(argv) == 0
    (config,) = seen
    assert config.epochs == 2 and config.resume == resume              # given flags win
    assert (config.imgsz, config.nbs, config.close_mosaic) == (256, 16, 5)  # the rest from the preset


def test_the_shapes_preset_applies_to_the_built_in_segmentation_set(monkeypatch, tmp_path):
    from yolokit import cli

    seen = []
    monkeypatch.setattr(cli, "train", lambda config: seen.append(config) or {})
    assert cli.main(["train", "--model", "yolov8n-seg", "--data", "shapes-seg", "--out", str(tmp_path / "r")]) == 0
    assert (seen[0].imgsz, seen[0].epochs, seen[0].batch, seen[0].close_mosaic) == (192, 20, 16, 5)
    assert seen[0].data == "shapes-seg"


def test_resuming_a_named_run_keeps_its_saved_config(monkeypatch, tmp_path):
    from yolokit import cli

    seen = []
    monkeypatch.setattr(cli, "train", lambda config: seen.append(config) or {})
    assert cli.main(["train", "--resume", str(tmp_path / "run")]) == 0
    assert seen[0].imgsz == 640 and seen[0].nbs == 64   # no preset: the checkpoint's config decides


def test_a_warning_is_one_line_naming_the_command(tmp_path):
    """A warning on the command line (here: CUDA graphs asked for on the CPU) is one line, not Python's
    file:line and the source line that raised it."""
    data = str(make_shapes(tmp_path / "set", n_train=8, n_val=4, imgsz=64))   # not the built-in 480 images
    cmd = [sys.executable, "-m", "yolokit.cli", "train", "--data", data, "--epochs", "1", "--imgsz", "32",
           "--batch", "4", "--cuda-graphs", "--device", "cpu", "--time", "0.00001", "--no-plots",
           "--out", str(tmp_path / "run")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    said = [line for line in result.stderr.splitlines() if "cuda_graphs cannot record" in line]
    assert said == ["yolokit train: warning: cuda_graphs cannot record this run's step: they need a CUDA device, "
                    "this run trains on cpu; it runs eagerly"]
    assert ".py:" not in result.stderr
