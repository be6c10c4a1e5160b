"""What the GPU machine's image lacks does not stop yolokit there: no pycocotools, no albumentations.

The lent GPU runs Python 3.12 with torch 2.11 and no package index; pycocotools and
albumentations are not installed. Here both are made unimportable in a subprocess (a
``sitecustomize`` that refuses them), and the library, the command line, validation with
the default evaluator, the GPU benchmark's plan and the collection of the ``gpu``-marked
tests must all work; the pycocotools backend names what it needs.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _torchrun_env import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
BLOCKER = """
import sys


class _NotOnTheImage:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pycocotools", "albumentations"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None


sys.meta_path.insert(0, _NotOnTheImage())
"""


@pytest.fixture(scope="module")
def image_env(tmp_path_factory):
    site = tmp_path_factory.mktemp("image-site")
    (site / "sitecustomize.py").write_text(BLOCKER)
    return {**subprocess_env(), "PYTHONPATH": str(site)}


def run(args: list[str], env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_library_validates_without_pycocotools_or_albumentations(image_env, tmp_path):
    script = tmp_path / "use.py"
    script.write_text(textwrap.dedent(f"""
        import importlib.util
        assert importlib.util.find_spec("torch") is not None
        try:
            import pycocotools  # noqa: F401
        except ModuleNotFoundError:
            pass
        else:
            raise SystemExit("the blocker did not work")
        import numpy as np, torch
        import yolokit, yolokit.cli, yolokit.train, yolokit.data, yolokit.predict  # noqa: F401
        from yolokit.ops import Detections
        from yolokit.val import coco_evaluate
        targets = [(np.array([[10.0, 10.0, 50.0, 50.0]]), np.array([0]))]
        preds = [Detections(torch.tensor([[10.0, 10.0, 50.0, 50.0]]), torch.tensor([0.9]), torch.tensor([0]))]
        print(coco_evaluate(preds, targets, shapes=[(64, 64)], num_classes=1).map50)
        try:
            coco_evaluate(preds, targets, shapes=[(64, 64)], num_classes=1, backend="pycocotools")
        except ImportError as exc:
            print("pycocotools:", exc)
        from yolokit.data import DetectionDataset, make_shapes
        try:
            DetectionDataset(make_shapes({str(tmp_path / 'set')!r}, n_train=4, n_val=2, imgsz=64), "train",
                             imgsz=64, augment=True, albumentations=[object()])
        except ImportError as exc:
            print("albumentations:", exc)
    """))
    done = run([sys.executable, str(script)], image_env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert float(lines[0]) == pytest.approx(1.0)
    assert lines[1].startswith("pycocotools:") and "pip install pycocotools" in lines[1]
    assert lines[2].startswith("albumentations:") and "albumentations" in lines[2]


@pytest.mark.extended   # benchmarks/gpu.py's smoke run (tests/bench) collects and skips them too, by default
def test_the_gpu_marked_tests_collect_without_them(image_env):
    done = run([sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider"],
               image_env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    assert len(collected) >= 5, done.stdout[-2000:]
