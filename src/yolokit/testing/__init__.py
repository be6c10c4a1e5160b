"""Testing your research code: assertions and pytest fixtures for yolokit models and data.

Installing yolokit registers this package with pytest (the ``pytest11`` entry point ``yolokit``), so every
test session has three fixtures, session-scoped:

- ``yolokit_shapes``: the data.yaml ``Path`` of a small built-in shapes set (16 training and 8 validation
  images of 64 pixels, the four classes of ``yolokit.data.SHAPE_NAMES``), made once in pytest's cache folder
  (``.pytest_cache``) and reused by later sessions;
- ``yolokit_shapes_factory``: ``make(*, n_train=16, n_val=8, imgsz=64, seed=0) -> Path``, another size of
  the same set, cached by its arguments;
- ``yolokit_tiny_model``: :func:`tiny_model`, ``yolokit_tiny_model("yolov8", num_classes=3)``.

The assertions need no pytest: :func:`assert_weights_equal`, :func:`assert_detections_close`
(``testing.compare``) and :func:`assert_learns` (``testing.learning``) raise an ``AssertionError`` that names
what differs. Importing this package is cheap, as pytest imports it in every session: torch and the rest of
yolokit load when a fixture or an assertion first runs. It is imported by name (``import yolokit.testing``),
not reached as an attribute of a bare ``import yolokit`` as the subpackages are: a tool for tests, not part
of a model's or a run's code.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
    import pytest
except ImportError:   # the assertions work without pytest; the fixtures are plain functions then
    pytest = None

from yolokit.testing.compare import assert_detections_close, assert_weights_equal
from yolokit.testing.learning import LearningCurve, assert_learns

if TYPE_CHECKING:
    from yolokit.models import Detector

__all__ = ["TINY_WIDTH", "LearningCurve", "assert_detections_close", "assert_learns", "assert_weights_equal",
           "tiny_model"]

TINY_WIDTH = 1 / 16
"""The width of :func:`tiny_model`'s scale: a sixteenth of the channels of the file's scale 1.0."""


def _fixture(**kwargs: Any) -> Callable:
    return pytest.fixture(**kwargs) if pytest is not None else (lambda function: function)


def tiny_model(name: str | os.PathLike | Mapping[str, Any] = "yolov8", *, num_classes: int = 4, seed: int = 0,
               modules: Mapping[str, Any] | None = None) -> Detector:
    """A real Detector of a family, narrowed to train in a fraction of a second a step on a CPU.

    The model YAML is built at a scale of its own: the depth and channel cap of the file's first scale (1/3
    and 1024 without ``scales``), the width ``TINY_WIDTH``. Every block and the head are the file's, so the
    loss, the decode and the trainer's paths are the family's (yolov8: 0.36 M parameters, yolo26: 0.2 M).
    The weights are drawn from ``seed``; the global random state is left as it was.

    Args:
        name: a family ("yolov8", "yolo26", "yolov3", "yolov3-tiny", "yolo11", ...: the packaged YAML of
            that name, ``yolokit.models.packaged_yamls()``), a model YAML's name or path (your own), or a
            YAML's content as a dict.
        num_classes: classes C (4: the shapes set's).
        seed: the seed of the initial weights.
        modules: your blocks, by the name the YAML's rows use (as ``yolokit.create_model`` takes them).

    Examples:
        >>> model = tiny_model("yolov8", num_classes=3)
        >>> [m.shape for m in model(torch.zeros(1, 3, 64, 64))]
        [torch.Size([1, 67, 8, 8]), torch.Size([1, 67, 4, 4]), torch.Size([1, 67, 2, 2])]
    """
    import torch

    from yolokit.models.spec import create_from_yaml
    from yolokit.models.spec_config import find_yaml, read_yaml

    if isinstance(name, Mapping):
        spec, stem = dict(name), Path(str(name.get("yaml_file") or "model")).stem
    else:
        path = Path(name)
        path = path if path.suffix in (".yaml", ".yml") else path.with_name(f"{path.name}.yaml")
        spec, stem = read_yaml(find_yaml(path)), path.stem
    scales = spec.get("scales")
    depth, _, max_channels = next(iter(scales.values())) if isinstance(scales, dict) and scales else (1 / 3, 1, 1024)
    spec.update(scales={"n": [depth, TINY_WIDTH, max_channels]}, scale="n")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return create_from_yaml(spec, scale="n", num_classes=num_classes, modules=modules, name=f"{stem}-narrow")


def _shapes(folder: Path, **sizes: int) -> Path:
    """The shapes set in ``folder`` (made there once); a set another yolokit drew there is drawn again."""
    from yolokit.data import make_shapes

    try:
        return make_shapes(folder, **sizes)
    except FileExistsError:
        shutil.rmtree(folder)
        return make_shapes(folder, **sizes)


@_fixture(scope="session")
def yolokit_shapes_factory(request: Any) -> Callable[..., Path]:
    """``make(*, n_train=16, n_val=8, imgsz=64, seed=0) -> Path``: a data.yaml of the built-in shapes set
    (four classes, ``imgsz`` pixels on the long side), drawn once into pytest's cache folder
    (``.pytest_cache/d/yolokit``; a temporary one when the cache is off) and found there again."""
    cache = getattr(request.config, "cache", None)   # None with -p no:cacheprovider
    if cache is not None:
        root = cache.mkdir("yolokit")
    else:
        root = request.getfixturevalue("tmp_path_factory").mktemp("yolokit")
    made: dict[tuple[int, ...], Path] = {}

    def make(*, n_train: int = 16, n_val: int = 8, imgsz: int = 64, seed: int = 0) -> Path:
        key = (n_train, n_val, imgsz, seed)
        if key not in made:
            made[key] = _shapes(root / "shapes-{}-{}-{}-{}".format(*key), n_train=n_train, n_val=n_val,
                                imgsz=imgsz, seed=seed)
        return made[key]

    return make


@_fixture(scope="session")
def yolokit_shapes(yolokit_shapes_factory: Callable[..., Path]) -> Path:
    """The data.yaml of a small shapes set: 16 training and 8 validation images of 64 pixels, 4 classes."""
    return yolokit_shapes_factory()


@_fixture(scope="session")
def yolokit_tiny_model() -> Callable[..., Detector]:
    """:func:`tiny_model`: ``yolokit_tiny_model("yolo26", num_classes=3)`` builds a fresh narrow model."""
    return tiny_model
