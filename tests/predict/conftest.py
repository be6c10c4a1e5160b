import cv2
import numpy as np
import pytest


def write_image(path, h=40, w=60, value=None, seed=0):
    """A random (or flat ``value``) BGR image written with OpenCV; returns its RGB content as read back."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    image = np.full((h, w, 3), value, np.uint8) if value is not None else rng.integers(0, 255, (h, w, 3), np.uint8)
    assert cv2.imwrite(str(path), image)
    return cv2.imread(str(path))[..., ::-1]


def write_video(path, frames=7, fps=12.0, size=(64, 48)):
    """An MJPG video whose frame i is flat grey 30 * i."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), fps, size)
    for i in range(frames):
        writer.write(np.full((size[1], size[0], 3), 30 * i, np.uint8))
    writer.release()
    return path


@pytest.fixture
def tree(tmp_path):
    """root/a/p.png, root/b/p.png, root/b/deep/q.jpg, root/clip.avi, root/a/notes.txt."""
    root = tmp_path / "root"
    write_image(root / "a" / "p.png", seed=1)
    write_image(root / "b" / "p.png", seed=2)
    write_image(root / "b" / "deep" / "q.jpg", h=30, w=30, seed=3)
    write_video(root / "clip.avi", frames=3)
    (root / "a" / "notes.txt").write_text("not an image")
    return root


@pytest.fixture(name="write_image")
def write_image_fixture():
    return write_image


@pytest.fixture(name="write_video")
def write_video_fixture():
    return write_video
