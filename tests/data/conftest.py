"""Shared helpers for the data tests: tiny datasets written on the fly."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest

from yolokit.data import make_shapes

# Distinct, saturated BGR colours, far from black and from the 114 letterbox grey.
COLOURS = [(0, 0, 255), (0, 255, 0), (255, 0, 0), (0, 255, 255), (255, 0, 255), (255, 255, 0)]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Every test gets its own yolokit cache folder (never ~/.cache)."""
    monkeypatch.setenv("YOLOKIT_CACHE", str(tmp_path / "yolokit-cache"))


@pytest.fixture(scope="session")
def shapes_yaml(tmp_path_factory) -> Path:
    """A small shapes set shared by the session (read-only for tests)."""
    root = tmp_path_factory.mktemp("shapes") / "set"
    return make_shapes(root, seed=0, n_train=24, n_val=12, imgsz=128)


def draw_rects(shape: tuple[int, int], rects: list[tuple[int, int, int, int]]) -> np.ndarray:
    """Black BGR image with filled rectangles [x1, y1, x2, y2) in COLOURS order."""
    image = np.zeros((*shape, 3), np.uint8)
    for k, (x1, y1, x2, y2) in enumerate(rects):
        image[y1:y2, x1:x2] = COLOURS[k]
    return image


def colour_extent(image: np.ndarray, k: int) -> np.ndarray | None:
    """xyxy pixel-edge extent of the pixels nearer COLOURS[k] than anything else, or None."""
    diff = np.abs(image.astype(np.int16) - np.array(COLOURS[k], np.int16)).max(-1)
    ys, xs = np.nonzero(diff < 100)
    if len(xs) == 0:
        return None
    return np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], np.float32)


def write_yolo_dataset(root: Path, items: dict[str, tuple[np.ndarray | bytes | None, str | None]],
                       names=("a", "b"), split="train") -> Path:
    """Write images/<split>/<name> and labels/<split>/<stem>.txt plus data.yaml.

    items maps file name -> (image array or raw bytes, label text or None for no file).
    """
    (root / "images" / split).mkdir(parents=True, exist_ok=True)
    (root / "labels" / split).mkdir(parents=True, exist_ok=True)
    for name, (image, label) in items.items():
        path = root / "images" / split / name
        if isinstance(image, bytes):
            path.write_bytes(image)
        elif image is not None:
            assert cv2.imwrite(str(path), image)
        if label is not None:
            (root / "labels" / split / (Path(name).stem + ".txt")).write_text(label)
    yaml = root / "data.yaml"
    yaml.write_text(f"path: {root}\n{split}: images/{split}\nnames: {list(names)}\n")
    return yaml
