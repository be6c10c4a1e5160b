"""Sources: what frames() yields for files, folders, globs, lists, in-memory images, videos and streams."""

import cv2
import numpy as np
import pytest
import torch
from PIL import Image

import yolokit.predict.sources as sources
from yolokit.predict import frames


def test_folder_is_searched_recursively_and_names_mirror_it(tree):
    got = list(frames(tree))
    assert [(f.name, f.frame) for f in got] == [("a/p.png", None), ("b/deep/q.jpg", None), ("b/p.png", None),
                                                ("clip.avi", 0), ("clip.avi", 1), ("clip.avi", 2)]
    assert got[0].image.shape == (3, 40, 60) and got[0].image.dtype == torch.uint8
    assert got[0].path == str(tree / "a" / "p.png")
    assert got[3].fps == pytest.approx(12.0) and got[3].frames == 3 and got[3].is_video


def test_pixels_are_rgb_as_written(tmp_path, write_image):
    rgb = write_image(tmp_path / "x.png", seed=5)
    (frame,) = frames(tmp_path / "x.png")
    assert torch.equal(frame.image, torch.from_numpy(rgb.copy()).permute(2, 0, 1))
    assert frame.name == "x.png"


def test_two_folders_keep_same_named_files_apart(tree):
    names = [f.name for f in frames([tree / "a", tree / "b"])]
    assert names == ["a/p.png", "b/deep/q.jpg", "b/p.png"]
    assert [f.name for f in frames([tree / "a" / "p.png", tree / "b" / "p.png"])] == ["a/p.png", "b/p.png"]


def test_glob_and_text_list(tree, tmp_path):
    assert [f.name for f in frames(str(tree / "**" / "*.png"))] == ["a/p.png", "b/p.png"]
    assert [f.name for f in frames(str(tree / "b" / "*"))] == ["p.png"]  # the glob's fixed part is the root
    listing = tmp_path / "list.txt"
    listing.write_text(f"# images to check\nroot/b/deep/q.jpg\n\n{tree / 'a' / 'p.png'}\n")
    got = list(frames(listing))
    assert [f.name for f in got] == ["b/deep/q.jpg", "a/p.png"] and got[0].image.shape == (3, 30, 30)
    with pytest.raises(FileNotFoundError, match="no images or videos match"):
        list(frames(str(tree / "*.bmp")))


def test_in_memory_images_of_every_kind(tmp_path):
    rgb = np.random.default_rng(0).integers(0, 255, (20, 30, 3), dtype=np.uint8)
    expected = torch.from_numpy(rgb).permute(2, 0, 1)
    for source in (rgb, Image.fromarray(rgb), expected, rgb[:, :, ::-1][:, :, ::-1]):
        (frame,) = frames(source)
        assert torch.equal(frame.image, expected) and frame.name == "image0.jpg" and frame.frame is None
    batch = list(frames(torch.zeros(3, 3, 8, 8, dtype=torch.uint8)))
    assert [f.name for f in batch] == ["image0.jpg", "image1.jpg", "image2.jpg"]
    Image.fromarray(rgb).save(tmp_path / "f.png")
    mixed = list(frames([rgb, tmp_path / "f.png", Image.fromarray(rgb)]))
    assert [f.name for f in mixed] == ["image0.jpg", "f.png", "image2.jpg"]
    assert all(torch.equal(f.image, expected) for f in mixed)


def test_video_frames_in_order_with_a_stride(tmp_path, write_video):
    video = write_video(tmp_path / "v.avi", frames=7, fps=12.0)
    got = list(frames(video))
    assert [f.frame for f in got] == list(range(7)) and all(f.name == "v.avi" for f in got)
    means = [float(f.image.float().mean()) for f in got]
    assert means == sorted(means) and abs(means[3] - 90) < 3  # frame i is grey 30 * i
    strided = list(frames(video, vid_stride=3))
    assert [f.frame for f in strided] == [0, 3, 6] and strided[0].fps == pytest.approx(4.0)


class FakeCapture:
    """Stands in for cv2.VideoCapture on a camera or stream: three frames, then the end."""

    opened = []

    def __init__(self, target):
        self.target, self.left = target, 3
        FakeCapture.opened.append(target)

    def isOpened(self):
        return self.target != "rtsp://down"

    def get(self, prop):
        return 25.0 if prop == cv2.CAP_PROP_FPS else 0.0

    def read(self):
        self.left -= 1
        return (True, np.zeros((6, 8, 3), np.uint8)) if self.left >= 0 else (False, None)

    def release(self):
        pass


def test_camera_index_and_stream_url_go_through_opencv(monkeypatch):
    monkeypatch.setattr(cv2, "VideoCapture", FakeCapture)  # read_video (yolokit.data.sources.images) opens them
    FakeCapture.opened.clear()
    cam = list(frames(0))
    assert [(f.name, f.frame, f.fps, f.frames) for f in cam] == [("camera0.mp4", i, 25.0, None) for i in range(3)]
    assert [f.name for f in frames("1")] == ["camera1.mp4"] * 3
    assert [f.path for f in frames("rtsp://cam/live")] == ["rtsp://cam/live"] * 3
    assert FakeCapture.opened == [0, 1, "rtsp://cam/live"]
    with pytest.raises(ValueError, match="OpenCV cannot open video or stream rtsp://down"):
        list(frames("rtsp://down"))


def test_frames_are_decoded_lazily(tree, monkeypatch):
    reads = []
    real = sources.read_image
    monkeypatch.setattr(sources, "read_image", lambda p: reads.append(p) or real(p))
    stream = frames(tree)
    assert reads == []
    next(stream)
    assert len(reads) == 1


def test_bad_inputs_name_the_problem(tmp_path, tree):
    with pytest.raises(FileNotFoundError, match="missing.jpg"):
        list(frames(tmp_path / "missing.jpg"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no images or videos in folder"):
        list(frames(tmp_path / "empty"))
    bad = tree / "a" / "broken.jpg"
    bad.write_bytes(b"\xff\xd8\xff not really a jpeg")
    with pytest.raises(ValueError, match="broken.jpg"):  # named directly: an error
        list(frames(bad))
    with pytest.warns(UserWarning, match="skipped .*broken.jpg"):  # found in a folder: skipped, said once
        names = [f.name for f in frames(tree / "a")]
    assert names == ["p.png"]
    with pytest.raises(ValueError, match="HxWx3"):
        list(frames(np.zeros((4, 4, 5), np.uint8)))
