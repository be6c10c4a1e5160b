"""The label cache is reused while nothing changes and rebuilt when something does."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import yolokit.data.sources.readers as sources
from yolokit.data.sources.readers import yolo_index


@pytest.fixture()
def dataset(tmp_path, shapes_yaml) -> Path:
    """A private, writable copy of the small shapes set."""
    root = tmp_path / "copy"
    shutil.copytree(shapes_yaml.parent, root)
    yaml = root / "data.yaml"
    yaml.write_text(yaml.read_text().replace(f"path: {shapes_yaml.parent}", f"path: {root}"))
    for cache in root.rglob("*.yolokit.cache"):
        cache.unlink()
    return yaml


@pytest.fixture()
def counted(monkeypatch):
    """Count image verifications (one per image whenever the index is rebuilt)."""
    calls = []
    real = sources.verify_image

    def verify(path):
        calls.append(path)
        return real(path)

    monkeypatch.setattr(sources, "verify_image", verify)
    return calls


def test_written_beside_labels_and_reused(dataset, counted):
    first = yolo_index(dataset, "train")
    cache = dataset.parent / "labels" / "train.yolokit.cache"
    assert cache.is_file() and len(counted) == 24
    second = yolo_index(dataset, "train")
    assert len(counted) == 24  # nothing verified again
    assert second.paths == first.paths
    assert (second.shapes == first.shapes).all()
    for a, b in zip(first.labels, second.labels, strict=True):
        np.testing.assert_array_equal(a, b)
    assert second.problems == first.problems
    assert second.names == first.names


def test_changed_label_file_rebuilds(dataset, counted):
    yolo_index(dataset, "train")
    label = dataset.parent / "labels" / "train" / "train_000001.txt"
    label.write_text("3 0.5 0.5 0.5 0.5\n")
    st = os.stat(label)
    os.utime(label, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    index = yolo_index(dataset, "train")
    assert len(counted) == 48
    i = [Path(p).name for p in index.paths].index("train_000001.jpg")
    h, w = index.shapes[i]
    np.testing.assert_allclose(index.labels[i], [[3, w / 4, h / 4, 3 * w / 4, 3 * h / 4]])


def test_added_or_removed_image_rebuilds(dataset, counted):
    yolo_index(dataset, "train")
    images = dataset.parent / "images" / "train"
    shutil.copy(images / "train_000000.jpg", images / "extra.jpg")
    assert len(yolo_index(dataset, "train")) == 25
    (images / "train_000003.jpg").unlink()
    assert len(yolo_index(dataset, "train")) == 24
    assert len(counted) == 24 + 25 + 24


def test_class_names_change_rebuilds(dataset, counted):
    yolo_index(dataset, "train")
    text = dataset.read_text().replace("  3: star\n", "")
    dataset.write_text(text)  # class 3 no longer exists: its rows must now be reported
    index = yolo_index(dataset, "train")
    assert len(counted) == 48
    assert all((lab[:, 0] < 3).all() for lab in index.labels)
    assert any("class id outside 0..2" in p.reason for p in index.problems)


def test_corrupt_cache_is_rebuilt(dataset, counted):
    yolo_index(dataset, "train")
    cache = dataset.parent / "labels" / "train.yolokit.cache"
    cache.write_bytes(b"garbage")
    assert len(yolo_index(dataset, "train")) == 24
    assert len(counted) == 48
    assert cache.stat().st_size > 100  # rewritten


def test_unwritable_label_folder_falls_back_to_cache_home(dataset, counted, tmp_path):
    cache = dataset.parent / "labels" / "train.yolokit.cache"
    cache.mkdir()  # a folder in the way: the cache cannot be written there
    yolo_index(dataset, "train")
    fallback = list((tmp_path / "yolokit-cache" / "labels").glob("*.yolokit.cache"))
    assert len(fallback) == 1
    yolo_index(dataset, "train")
    assert len(counted) == 24  # the fallback copy was reused


def test_cache_disabled(dataset, counted):
    yolo_index(dataset, "train", cache=False)
    yolo_index(dataset, "train", cache=False)
    assert len(counted) == 48
    assert not (dataset.parent / "labels" / "train.yolokit.cache").exists()


def test_list_splits_sharing_a_label_folder_keep_separate_caches(dataset, counted):
    root = dataset.parent
    names = sorted(p.name for p in (root / "images" / "train").glob("*.jpg"))
    (root / "a.txt").write_text("".join(f"./images/train/{n}\n" for n in names[:10]))
    (root / "b.txt").write_text("".join(f"./images/train/{n}\n" for n in names[10:]))
    dataset.write_text(f"path: {root}\ntrain: a.txt\nval: b.txt\n"
                       "test: [images/train, images/val]\nnames: [a, b, c, d]\n")
    sizes = [len(yolo_index(dataset, s)) for s in ("train", "val", "test")]
    assert sizes == [10, 14, 36] and len(counted) == 60
    assert (root / "a.yolokit.cache").is_file() and (root / "b.yolokit.cache").is_file()
    assert len(list((root / "labels").glob("train.*.yolokit.cache"))) == 1  # the list split
    for s in ("train", "val", "test"):
        yolo_index(dataset, s)
    assert len(counted) == 60  # all three reused
