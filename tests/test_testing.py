"""yolokit.testing: the pytest plugin's fixtures (active in this suite too, as in any project with yolokit
installed), and each assertion: what it accepts, what it refuses, and what its message names.

One pytest subprocess in the default run (a user's test file, a passing and a failing test); the guide's
test file (docs/testing.md) runs with ``-m extended``, as does ``assert_learns`` on the other families.
"""

from __future__ import annotations

import copy
import importlib.metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from yolokit.models.layers import SPPF
from yolokit.ops import Detections
from yolokit.testing import TINY_WIDTH, assert_detections_close, assert_learns, assert_weights_equal, tiny_model
from yolokit.train.ema import ModelEMA

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parents[1]


# --- the plugin ----------------------------------------------------------------------------------------------


def test_the_plugin_is_registered_and_costs_no_torch_to_import():
    (entry,) = [e for e in importlib.metadata.entry_points(group="pytest11") if e.name == "yolokit"]
    assert entry.value == "yolokit.testing"
    code = ("import sys; sys.modules['pytest'] = None; import yolokit.testing as t\n"   # as without pytest
            "print('torch' in sys.modules, type(t.yolokit_shapes).__name__, t.assert_learns.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "function", "yolokit.testing.learning"]


USERS_TESTS = """
import copy

import torch

from yolokit.testing import assert_weights_equal


def test_the_fixtures(yolokit_shapes, yolokit_shapes_factory, yolokit_tiny_model):
    assert yolokit_shapes.name == "data.yaml" and yolokit_shapes_factory() == yolokit_shapes
    model = yolokit_tiny_model("yolov8", num_classes=3)
    assert (model.name, model.num_classes) == ("yolov8-narrow", 3)
    assert_weights_equal(model, yolokit_tiny_model("yolov8", num_classes=3))


def test_a_changed_bias(yolokit_tiny_model):
    model = yolokit_tiny_model("yolov8", num_classes=3)
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.get_parameter("head.cls.0.2.bias")[1] += 0.25
    assert_weights_equal(model, other)
"""


def test_a_users_test_file_finds_the_fixtures_and_a_failure_names_its_tensor(pytester):
    """A fresh pytest process in a folder with no conftest.py: the entry point brings the fixtures."""
    pytester.makepyfile(test_users=USERS_TESTS)
    result = pytester.runpytest_subprocess("-q", timeout=300)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*AssertionError: weights differ: first differing tensor head.cls.0.2.bias: "
                                 "1 of 3 elements differ, max abs difference 0.25, the first at [[]1[]]*"])
    assert (pytester.path / ".pytest_cache" / "d" / "yolokit" / "shapes-16-8-64-0" / "data.yaml").is_file()


def guide_test_file() -> str:
    text = (ROOT / "docs" / "testing.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "def test_" in b]
    return block


@pytest.mark.extended   # 10 s: the fixtures and assertions on a user's block, as the guide shows them
def test_the_guides_test_file_passes(pytester):
    pytester.makepyfile(test_gated_sppf=guide_test_file())
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", timeout=300)   # shapes in a tmp folder
    result.assert_outcomes(passed=3)


# --- the fixtures and tiny models ----------------------------------------------------------------------------


def test_the_shapes_sets_are_drawn_once_into_pytests_cache(yolokit_shapes, yolokit_shapes_factory, pytestconfig):
    if getattr(pytestconfig, "cache", None) is None:      # -p no:cacheprovider (the GPU command's pytest)
        pytest.skip("no cache provider: the sets go to a temporary folder (test_the_guides_test_file_passes)")
    root = pytestconfig.cache.mkdir("yolokit")
    assert yolokit_shapes == root / "shapes-16-8-64-0" / "data.yaml"
    assert [len(list((yolokit_shapes.parent / "images" / split).glob("*.jpg"))) for split in ("train", "val")] == [
        16, 8]
    stale = root / "shapes-2-1-32-5"            # a folder another yolokit (or anything else) left there
    shutil.rmtree(stale, ignore_errors=True)
    stale.mkdir()
    (stale / "left.txt").write_text("x")
    small = yolokit_shapes_factory(n_train=2, n_val=1, imgsz=32, seed=5)
    assert small == stale / "data.yaml" and not (stale / "left.txt").exists()
    assert yolokit_shapes_factory(n_train=2, n_val=1, imgsz=32, seed=5) is small
    assert yolokit_shapes_factory() == yolokit_shapes


@pytest.mark.parametrize("family, head, levels, channels", [("yolov8", "DFLHead", 3, 68),
                                                            ("yolo26", "EndToEndHead", 3, 8),
                                                            ("yolov3", "AnchorHead", 3, 27),
                                                            ("yolov3-tiny", "AnchorHead", 2, 27)])
def test_a_tiny_model_is_its_familys_network_narrowed(yolokit_tiny_model, family, head, levels, channels):
    state = torch.get_rng_state()
    model = yolokit_tiny_model(family)
    assert torch.equal(torch.get_rng_state(), state)                       # seeded apart from the global RNG
    assert model.name == f"{family}-narrow" and model.num_classes == 4 and type(model.head).__name__ == head
    assert sum(p.numel() for p in model.parameters()) < 400_000
    assert_weights_equal(model, yolokit_tiny_model(family))                   # the same seed, the same weights
    with pytest.raises(AssertionError):
        assert_weights_equal(model, yolokit_tiny_model(family, seed=1))
    maps = model(torch.rand(1, 3, 64, 64))
    maps = maps["one2many"] if isinstance(maps, dict) else maps
    assert len(maps) == levels and [tuple(m.shape) for m in maps] == [(1, channels, 64 // s, 64 // s)
                                                                       for s in model.strides]


def test_a_tiny_model_from_a_path_or_its_content():
    mine = tiny_model(ROOT / "tests" / "fixtures" / "tiny.yaml", num_classes=2)   # a file without scales
    assert mine.name == "tiny-narrow" and mine.config.scale == "n" and mine.num_classes == 2
    assert mine.config.spec["scales"] == {"n": [1 / 3, TINY_WIDTH, 1024]}
    again = tiny_model(tiny_model("yolo11").config.spec)                     # its content: the same network
    assert_weights_equal(tiny_model("yolo11"), again)
    assert again.config.spec["scales"] == {"n": [0.5, TINY_WIDTH, 1024]}       # yolo11's depth at scale n


# --- assert_weights_equal ------------------------------------------------------------------------------------


def message(check, *args, **kwargs) -> str:
    with pytest.raises(AssertionError) as failed:
        check(*args, **kwargs)
    return str(failed.value)


def test_one_ulp_in_one_element_is_found_and_named():
    model = tiny_model("yolov8")
    other = copy.deepcopy(model)
    key = "neck.15.m.0.cv1.conv.weight"
    with torch.no_grad():
        weight = other.get_parameter(key)
        old = weight[3, 1, 0, 0].clone()
        weight[3, 1, 0, 0] = torch.nextafter(old, torch.tensor(float("inf")))
    assert_weights_equal(model, copy.deepcopy(model))
    said = message(assert_weights_equal, model, other)
    ulp = (torch.nextafter(old, torch.tensor(float("inf"))) - old).item()
    assert said.startswith(f"weights differ: first differing tensor {key}: 1 of {weight.numel()} elements differ, "
                           f"max abs difference {ulp:.6g}, the first at [3, 1, 0, 0]: ")
    assert "also" not in said and "only in" not in said


def test_modules_emas_and_state_dicts_compare_and_every_difference_is_listed():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    ema = ModelEMA(model)
    assert_weights_equal(model, ema)
    assert_weights_equal(ema, nn.DataParallel(model))                          # wrappers are looked through
    assert_weights_equal(model, dict(reversed(model.state_dict().items())))   # the keys' order does not matter
    other = copy.deepcopy(model.state_dict())
    other["1.running_var"] = other["1.running_var"].double()
    other["0.bias"] = other["0.bias"][:3]
    del other["1.weight"]
    other["2.weight"] = torch.zeros(1)
    said = message(assert_weights_equal, model, other).splitlines()
    assert said == ["weights differ: first differing tensor 0.bias: torch.float32 (4,) in a, torch.float32 (3,) in b",
                    "  also 1.running_var: torch.float32 (4,) in a, torch.float64 (4,) in b",
                    "  only in a (1): 1.weight", "  only in b (1): 2.weight"]


def test_bits_decide_not_values():
    a = {"zero": torch.tensor([0.0]), "nan": torch.tensor([float("nan")]), "steps": torch.tensor(3)}
    assert_weights_equal(a, copy.deepcopy(a))                                 # NaN is the same NaN
    said = message(assert_weights_equal, a, {**a, "zero": torch.tensor([-0.0])})
    assert said == "weights differ: first differing tensor zero: 1 of 1 elements differ, max abs difference 0, " \
                   "the first at [0]: 0.0 in a, -0.0 in b"
    assert "steps: 1 of 1 elements differ, max abs difference 1, the first at []: 3 in a, 4 in b" in message(
        assert_weights_equal, a, {**a, "steps": torch.tensor(4)})
    with pytest.raises(TypeError, match="modules, EMAs or state dicts"):
        assert_weights_equal(a, [1, 2])


# --- assert_detections_close ---------------------------------------------------------------------------------


def detections(boxes, scores, labels) -> Detections:
    return Detections(torch.tensor(boxes, dtype=torch.float32), torch.tensor(scores), torch.tensor(labels))


ONE = detections([[0, 0, 10, 10], [5, 5, 20, 20], [30, 30, 60, 50]], [0.9, 0.8, 0.8], [1, 2, 2])


def test_detections_match_in_any_order_within_the_tolerances():
    turned = detections(ONE.boxes.flip(0).tolist(), ONE.scores.flip(0).tolist(), ONE.labels.flip(0).tolist())
    assert_detections_close(ONE, turned, atol=0, rtol=0)
    assert_detections_close([ONE, turned], [turned.numpy(), ONE.numpy()], atol=0, rtol=0)   # numpy too
    near = Detections(ONE.boxes + 0.9e-2, ONE.scores - 0.9e-2, ONE.labels)
    assert_detections_close(ONE, near, atol=1e-2, rtol=0)
    with pytest.raises(AssertionError):
        assert_detections_close(ONE, near, atol=0.8e-2, rtol=0)
    scaled = Detections(ONE.boxes * 1.009, ONE.scores * 1.009, ONE.labels)
    assert_detections_close(ONE, scaled, atol=0, rtol=1e-2)                   # relative to b's values
    with pytest.raises(AssertionError):
        assert_detections_close(ONE, scaled, atol=0, rtol=0.8e-2)
    empty = detections(torch.zeros(0, 4).tolist(), [], [])
    assert_detections_close([empty], [Detections(torch.zeros(0, 4), torch.zeros(0), torch.zeros(0, dtype=int))])


def test_the_message_names_the_image_and_the_first_detection_without_a_pair():
    moved = Detections(ONE.boxes.clone(), ONE.scores.clone(), ONE.labels.clone())
    moved.boxes[2, 3] += 0.5
    said = message(assert_detections_close, [ONE, ONE], [ONE, moved], atol=1e-3, rtol=0).splitlines()
    assert said == ["detections differ in image 1 (3 in a, 3 in b; atol=0.001, rtol=0)",
                    "  first differing detection: a's box [30, 30, 60, 50], score 0.8, label 2 has no match in b; "
                    "the nearest of its label there: box [30, 30, 60, 50.5], score 0.8, label 2 (box off by "
                    "0.5, score by 0)",
                    "  unmatched: 1 in a, 1 in b"]
    relabelled = detections(ONE.boxes.tolist(), ONE.scores.tolist(), [1, 3, 3])
    assert "a's box [5, 5, 20, 20], score 0.8, label 2 has no match in b\n" in message(
        assert_detections_close, ONE, relabelled)                              # no other of label 2 to show
    fewer = detections(ONE.boxes[:2].tolist(), ONE.scores[:2].tolist(), ONE.labels[:2].tolist())
    assert "(2 in a, 3 in b;" in message(assert_detections_close, fewer, ONE)
    assert "b's box [30, 30, 60, 50]" in message(assert_detections_close, fewer, ONE)
    assert message(assert_detections_close, [ONE], [ONE, ONE]) == "detections of 1 images in a, of 2 in b"
    assert message(assert_detections_close, ONE, [ONE]) == "a is one image, b a list"


# --- assert_learns -------------------------------------------------------------------------------------------


class GatedSPPF(nn.Module):
    def __init__(self, c1, c2, k=5):
        super().__init__()
        self.sppf = SPPF(c1, c2, k)
        self.gate = nn.Conv2d(c2, c2, 1)

    def forward(self, x):
        y = self.sppf(x)
        return y * torch.sigmoid(self.gate(y))


class Forgetful(GatedSPPF):
    def forward(self, x):
        return self.sppf(x)


def with_block(block: type[nn.Module]) -> nn.Module:
    spec = tiny_model("yolov8").config.spec
    spec["backbone"][9][2] = "GatedSPPF"
    return tiny_model(spec, modules={"GatedSPPF": block})


def test_a_tiny_model_learns_and_is_left_as_it_was(yolokit_shapes):
    model = with_block(GatedSPPF)
    before, state = copy.deepcopy(model), torch.get_rng_state()
    curve = assert_learns(model, yolokit_shapes)
    assert len(curve.losses) == 15 and curve.fit[0] < 0.01 and curve.fit[1] > 0.04
    assert_weights_equal(model, before)
    assert model.training == before.training and torch.equal(torch.get_rng_state(), state)
    assert assert_learns(model, yolokit_shapes, steps=2, min_gain=0).losses == curve.losses[:2]   # deterministic


def test_a_block_left_out_of_the_forward_pass_is_named(yolokit_shapes):
    said = message(assert_learns, with_block(Forgetful), yolokit_shapes, steps=1)
    assert re.search(r"2 of \d+ trainable parameters get no gradient from the output \(is their block in the "
                     r"forward pass\?\): backbone\.9\.gate\.weight, backbone\.9\.gate\.bias\n", said), said


def test_a_model_that_does_not_move_or_a_loss_that_is_not_finite_fails(yolokit_shapes):
    model = tiny_model("yolov3-tiny")
    said = message(assert_learns, model, yolokit_shapes, steps=2, lr=0.0)
    assert re.search(r"the fit rose from (\d\.\d{4}) to \1 in 2 steps \(needs \+0\.02\)", said), said

    def nan_loss(maps, targets):
        return sum(m.sum() for m in maps) * float("nan"), {}

    said = message(assert_learns, model, yolokit_shapes, steps=3, loss=nan_loss)
    assert "the loss is nan at step 0" in said and said.endswith("losses: nan") and "no gradient" not in said


@pytest.mark.extended   # 2-4 s each; the default run trains the YOLOv8 form above
@pytest.mark.parametrize("family", ["yolo26", "yolov3", "yolo11"])
def test_every_family_learns(yolokit_tiny_model, yolokit_shapes, family):
    curve = assert_learns(yolokit_tiny_model(family), yolokit_shapes)
    assert all(np.isfinite(curve.losses))
