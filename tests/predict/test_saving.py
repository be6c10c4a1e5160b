"""ResultWriter: the run folder's layout, no overwrites, streamed JSON, videos at the source's rate."""

import json

import cv2
import pytest
import torch

from yolokit.ops.nms import Detections
from yolokit.predict import Result, ResultWriter, next_run_dir


def result(name, frame=None, fps=None, h=24, w=32, label=0):
    return Result(torch.tensor([[2.0, 2.0, 12.0, 10.0]]), torch.tensor([0.5]), torch.tensor([label]),
                  ["cat", "dog"], f"src/{name}", name, (h, w), torch.full((3, h, w), 100, dtype=torch.uint8),
                  frame, fps)


def test_layout_and_same_stems_do_not_overwrite(tmp_path):
    with ResultWriter(tmp_path, save_txt=True, save_crop=True, save_json=True) as writer:
        for name in ("a/x.jpg", "a/x.png", "b/x.jpg", "007.jpg"):
            writer.write(result(name, label=1 if name.startswith("b") else 0))
    assert cv2.imread(str(tmp_path / "a" / "x.jpg")).shape == (24, 32, 3)
    assert (tmp_path / "a" / "x.png").is_file() and (tmp_path / "b" / "x.jpg").is_file()
    labels = sorted(p.relative_to(tmp_path / "labels").as_posix() for p in (tmp_path / "labels").rglob("*.txt"))
    assert labels == ["007.txt", "a/x.txt", "a/x_png.txt", "b/x.txt"]
    crops = sorted(p.relative_to(tmp_path / "crops").as_posix() for p in (tmp_path / "crops").rglob("*.jpg"))
    assert crops == ["cat/007_0.jpg", "cat/a/x_0.jpg", "cat/a/x_png_0.jpg", "dog/b/x_0.jpg"]
    records = json.loads((tmp_path / "predictions.json").read_text())
    assert [r["image_id"] for r in records] == ["a/x", "a/x_png", "b/x", 7]  # numeric stems as COCO ids


def test_validation_sink_writes_labels_and_json_with_the_given_ids(tmp_path):
    det = Detections(torch.tensor([[2.0, 4.0, 12.0, 10.0], [0.0, 0.0, 32.0, 24.0]]), torch.tensor([0.5, 0.25]),
                     torch.tensor([1, 0]))
    with ResultWriter(tmp_path, save=False, save_txt=True, save_conf=True, save_json=True,
                      category_ids=[3, 7]) as writer:
        sink = writer.validation_sink(["cat", "dog"], image_ids=[101, 205])
        sink(1, "data/images/0042.jpg", (24, 32), det)   # dataset index 1: json image 205
        sink(0, "data/images/x.png", (24, 32), Detections(torch.zeros(0, 4), torch.zeros(0),
                                                          torch.zeros(0, dtype=torch.long)))
    records = json.loads((tmp_path / "predictions.json").read_text())
    assert records == [{"image_id": 205, "category_id": 7, "bbox": [2.0, 4.0, 10.0, 6.0], "score": 0.5},
                       {"image_id": 205, "category_id": 3, "bbox": [0.0, 0.0, 32.0, 24.0], "score": 0.25}]
    assert (tmp_path / "labels" / "0042.txt").read_text().splitlines() == [
        "1 0.218750 0.291667 0.312500 0.250000 0.5", "0 0.500000 0.500000 1.000000 1.000000 0.25"]
    assert (tmp_path / "labels" / "x.txt").read_text() == ""   # an image without detections: an empty file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["labels", "predictions.json"]  # no drawings
    with ResultWriter(tmp_path / "plain", save=False, save_json=True) as writer:  # no ids: stems, class indices
        writer.validation_sink(["cat", "dog"])(0, "data/images/0042.jpg", (24, 32), det)
    assert [(r["image_id"], r["category_id"]) for r in json.loads((tmp_path / "plain" / "predictions.json")
                                                                  .read_text())] == [(42, 1), (42, 0)]
    with pytest.raises(ValueError, match="save=False"), ResultWriter(tmp_path / "drawn") as writer:
        writer.validation_sink(["cat"])


def test_json_is_valid_when_nothing_was_detected(tmp_path):
    with ResultWriter(tmp_path, save=False, save_json=True):
        pass
    assert json.loads((tmp_path / "predictions.json").read_text()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["predictions.json"]


def test_video_frames_become_one_video_per_source(tmp_path):
    with ResultWriter(tmp_path, save_txt=True) as writer:
        for i in range(5):
            writer.write(result("clips/v.avi", frame=i, fps=15.0))
        for i in range(2):
            writer.write(result("w.mp4", frame=i, fps=7.5, h=32, w=48))
    for name, fps, count, size in (("clips/v.mp4", 15.0, 5, (32, 24)), ("w.mp4", 7.5, 2, (48, 32))):
        capture = cv2.VideoCapture(str(tmp_path / name))
        assert capture.get(cv2.CAP_PROP_FPS) == pytest.approx(fps)
        assert int(capture.get(cv2.CAP_PROP_FRAME_COUNT)) == count
        assert (capture.get(cv2.CAP_PROP_FRAME_WIDTH), capture.get(cv2.CAP_PROP_FRAME_HEIGHT)) == size
        capture.release()
    assert sorted(p.name for p in (tmp_path / "labels" / "clips").iterdir()) == [f"v_{i}.txt" for i in range(5)]


def test_next_run_dir_counts_up(tmp_path):
    assert next_run_dir(tmp_path / "predict") == tmp_path / "predict"
    (tmp_path / "predict").mkdir()
    assert next_run_dir(tmp_path / "predict") == tmp_path / "predict2"
    (tmp_path / "predict2").mkdir()
    assert next_run_dir(tmp_path / "predict") == tmp_path / "predict3"
