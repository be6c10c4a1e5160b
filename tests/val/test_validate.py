"""The validation pass: the protocol's keywords, ground truth in original pixels, samples, per-image sink."""

import types

import numpy as np
import pytest
import torch

from yolokit.ops.nms import Detections
from yolokit.val import validate


class FakeDetector(torch.nn.Module):
    """Answers predict() with one box per image at a fixed place (scores 0.9, 0.8, ...), recording the keywords."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.calls = []

    def predict(self, images, **kwargs):
        self.calls.append(kwargs)
        return [Detections(torch.tensor([[0.0, 0.0, 10.0, 10.0]]), torch.tensor([0.9 - 0.1 * i]), torch.tensor([0]))
                for i in range(len(images))]


def test_validate_uses_the_protocol_and_returns_labelled_samples(tmp_path):
    from PIL import Image

    Image.fromarray(np.full((20, 20, 3), 50, np.uint8)).save(tmp_path / "a.png")
    batch = {"images": torch.zeros(2, 3, 32, 32), "orig_shapes": [(20, 20), (20, 20)],
             "ratio_pad": [((1.0, 1.0), (0.0, 0.0))] * 2, "paths": [str(tmp_path / "a.png"), "missing.png"],
             "indices": [1, 0], "targets": torch.tensor([[0, 0, 0.0, 0.0, 10.0, 10.0], [1, 0, 5.0, 5.0, 15.0, 15.0]])}
    model = FakeDetector()
    result, samples = validate(model, [batch], num_classes=1, keep_samples=2, progress=True)
    assert model.calls[0]["multi_label"] is True and model.calls[0]["conf"] == 0.001
    assert model.calls[0]["iou"] == 0.7 and model.calls[0]["max_det"] == 300
    assert result.images == 2 and result.class_instances.tolist() == [2]
    assert result.map50 == pytest.approx(51 / 101 * 1.0)  # the surer box hits, the other misses: R <= 0.5
    image, pred, truth = samples[0]
    assert image.shape == (20, 20, 3) and image[0, 0, 0] == 50 and len(pred) == 1
    assert truth.boxes.tolist() == [[0.0, 0.0, 10.0, 10.0]] and truth.scores.tolist() == [1.0]
    assert (samples[1][0] == 114).all()  # an unreadable image shows grey
    validate(model, [batch], num_classes=1, multi_label=False)
    assert model.calls[-1]["multi_label"] is False


def test_validate_hands_each_image_to_on_image():
    batch = {"images": torch.zeros(2, 3, 32, 32), "orig_shapes": [(20, 30), (24, 20)],
             "ratio_pad": [((1.0, 1.0), (0.0, 0.0))] * 2, "paths": ["b.png", "a.png"],
             "indices": [1, 0], "targets": torch.tensor([[0, 0, 0.0, 0.0, 10.0, 10.0]])}
    seen = []
    result, _ = validate(FakeDetector(), [batch], num_classes=1,
                         on_image=lambda *args: seen.append(args))
    assert [(i, path, shape) for i, path, shape, _ in seen] == [(1, "b.png", (20, 30)), (0, "a.png", (24, 20))]
    assert [d.scores.tolist() for *_, d in seen] == [[pytest.approx(0.9)], [pytest.approx(0.8)]]
    assert all(d.boxes.device.type == "cpu" for *_, d in seen)
    assert result.images == 2  # scored as before


class Loader(list):
    """Batches with a ``dataset`` beside them, as a DataLoader has."""

    def __init__(self, batches, dataset):
        super().__init__(batches)
        self.dataset = dataset


def test_the_result_is_named_by_the_split_else_by_the_model():
    batch = {"images": torch.zeros(1, 3, 32, 32), "orig_shapes": [(20, 20)], "ratio_pad": [((1.0, 1.0), (0.0, 0.0))],
             "paths": ["a.png"], "indices": [0], "targets": torch.tensor([[0, 1, 0.0, 0.0, 10.0, 10.0]])}
    model = FakeDetector()
    split = types.SimpleNamespace(names={0: "cat", 1: "<dog>"})           # a data.yaml's names by id
    result, _ = validate(model, Loader([batch], split), num_classes=2)
    assert result.names == ["cat", "<dog>"] and "<td>&lt;dog&gt;</td>" in result._repr_html_()
    model.names = ["a", "b"]
    assert validate(model, [batch], num_classes=2)[0].names == ["a", "b"]               # no dataset: the model's
    assert validate(model, Loader([batch], split), num_classes=2)[0].names == ["cat", "<dog>"]  # the split's first
    assert validate(model, [batch], num_classes=3)[0].names is None    # names of another number of classes
