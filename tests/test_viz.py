import numpy as np
import pytest
import torch

from yolokit.ops.nms import Detections
from yolokit.viz import class_colour, draw_detections


def test_draws_box_in_class_colour_and_caption_without_touching_input():
    image = np.zeros((100, 120, 3), dtype=np.uint8)
    det = Detections(torch.tensor([[20.0, 40.0, 80.0, 90.0]]), torch.tensor([0.9]), torch.tensor([3]))
    out = draw_detections(image, det, ["a", "b", "c", "dog"], thickness=1)
    assert image.max() == 0 and out.shape == image.shape
    colour = class_colour(3)
    assert tuple(out[60, 20]) == colour and tuple(out[90, 50]) == colour  # left edge, bottom edge
    assert tuple(out[65, 50]) == (0, 0, 0)  # inside stays untouched
    caption = out[20:40, 20:80]
    assert (caption == colour).all(axis=-1).sum() > 50  # caption background sits above the box


def test_names_mapping_and_numpy_detections():
    image = np.full((50, 50, 3), 255, dtype=np.uint8)
    det = Detections(np.array([[5.0, 20.0, 45.0, 45.0]]), np.array([0.5]), np.array([0]))
    out = draw_detections(image, det, {0: "x"})
    assert (out != 255).any()


def test_rejects_wrong_image():
    det = Detections(torch.zeros(0, 4), torch.zeros(0), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="uint8 RGB"):
        draw_detections(np.zeros((10, 10), np.uint8), det)
