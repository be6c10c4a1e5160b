import numpy as np
import pytest
import torch
from PIL import Image

from yolokit.ops.images import letterbox, letterbox_batch, load_images, to_image_tensor


def test_letterbox_keeps_ratio_and_pads_grey():
    image = torch.full((3, 100, 200), 255, dtype=torch.uint8)
    out, ((rw, rh), (pw, ph)) = letterbox(image, (64, 64))
    assert out.shape == (3, 64, 64) and out.dtype == torch.float32
    assert (rw, rh) == (0.32, 0.32) and (pw, ph) == (0.0, 16.0)
    assert torch.allclose(out[:, :16], torch.tensor(114 / 255))  # top padding
    assert torch.allclose(out[:, 16:48], torch.tensor(1.0))  # the image itself
    auto, (_, (pw2, ph2)) = letterbox(image, (64, 64), stride=32, auto=True)
    assert auto.shape == (3, 32, 64) and ph2 == 0.0  # rectangle: only up to the stride multiple


def test_letterbox_no_scaleup():
    image = torch.zeros(3, 10, 20, dtype=torch.uint8)
    out, ((rw, _), (pw, ph)) = letterbox(image, (64, 64), scaleup=False)
    assert rw == 1.0 and (pw, ph) == (22.0, 27.0) and out.shape == (3, 64, 64)


def test_letterbox_batch_rectangle_for_one_shape_square_for_mixed():
    same = [torch.zeros(3, 100, 200, dtype=torch.uint8)] * 2
    batch, pads = letterbox_batch(same, 60, 32)  # 60 rounds up to 64
    assert batch.shape == (2, 3, 32, 64) and pads[0] == ((0.32, 0.32), (0.0, 0.0))
    mixed, pads = letterbox_batch([same[0], torch.zeros(3, 50, 50, dtype=torch.uint8)], 64, 32)
    assert mixed.shape == (2, 3, 64, 64) and pads[1] == ((1.28, 1.28), (0.0, 0.0))


def test_in_memory_images_of_every_kind():
    rgb = np.zeros((20, 30, 3), dtype=np.uint8)
    rgb[..., 0] = 200  # red
    expected = torch.from_numpy(rgb).permute(2, 0, 1)
    assert torch.equal(to_image_tensor(rgb), expected)
    assert torch.equal(to_image_tensor(Image.fromarray(rgb).convert("RGBA")), expected)
    assert torch.equal(to_image_tensor(np.ascontiguousarray(rgb[..., ::-1])[..., ::-1]), expected)  # negative strides
    readonly = rgb.copy()
    readonly.flags.writeable = False
    assert torch.equal(to_image_tensor(readonly), expected)
    gray = to_image_tensor(np.full((5, 6), 7, np.uint8))
    assert gray.shape == (3, 5, 6) and (gray == 7).all()
    assert len(load_images([rgb, Image.fromarray(rgb)])) == 2
    assert [t.shape for t in load_images(torch.zeros(2, 3, 8, 8))] == [(3, 8, 8)] * 2
    assert load_images(rgb)[0].shape == (3, 20, 30)


def test_bad_inputs_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="HxWx3"):
        to_image_tensor(np.zeros((4, 4, 5), dtype=np.uint8))
    with pytest.raises(ValueError, match=r"Tensor\[3, H, W\]"):
        to_image_tensor(torch.zeros(1, 4, 4))
    with pytest.raises(TypeError, match="yolokit.predict"):
        to_image_tensor(tmp_path / "a.jpg")
