"""The one pixel path: letterbox by the plan, in-memory images to tensors, video frames."""

import cv2
import numpy as np
import pytest
import torch
from PIL import Image

from yolokit.data.sources.images import bgr_to_tensor, image_tensor, letterbox, read_video
from yolokit.ops.geometry import letterbox_plan


@pytest.mark.parametrize("h, w", [(7, 13), (333, 500), (97, 61), (120, 128)])
@pytest.mark.parametrize("new_shape, auto", [(64, False), ((96, 200), False), (200, True), ((65, 33), False)])
def test_letterbox_follows_the_plan(h, w, new_shape, auto):
    image = np.random.default_rng(h * w).integers(0, 255, (h, w, 3), dtype=np.uint8)
    out, ratio_pad = letterbox(image, new_shape, auto=auto)
    plan = letterbox_plan((h, w), new_shape, auto=auto)
    assert ratio_pad == plan.ratio_pad and out.shape[:2] == plan.shape and out.dtype == np.uint8
    left, top, right, bottom = plan.pad
    assert (out[:top] == 114).all() and (out[out.shape[0] - bottom:] == 114).all()
    assert (out[:, :left] == 114).all() and (out[:, out.shape[1] - right:] == 114).all()
    inside = out[top:out.shape[0] - bottom, left:out.shape[1] - right]
    assert inside.shape[:2] == plan.size
    np.testing.assert_array_equal(inside, cv2.resize(image, plan.size[::-1], interpolation=cv2.INTER_LINEAR)
                                  if plan.size != (h, w) else image)


def test_in_memory_images_of_every_kind_become_uint8_rgb_tensors():
    rgb = np.zeros((20, 30, 3), dtype=np.uint8)
    rgb[..., 0] = 200  # red
    rgb[3, 4] = (1, 2, 3)
    expected = torch.from_numpy(rgb).permute(2, 0, 1)
    assert torch.equal(image_tensor(rgb), expected) and image_tensor(rgb).dtype == torch.uint8
    assert torch.equal(image_tensor(Image.fromarray(rgb).convert("RGBA")), expected)
    assert torch.equal(image_tensor(np.ascontiguousarray(rgb[..., ::-1])[..., ::-1]), expected)  # negative strides
    readonly = rgb.copy()
    readonly.flags.writeable = False
    assert torch.equal(image_tensor(readonly), expected)
    assert torch.equal(image_tensor(expected.float() / 255), expected)  # float in [0, 1]: back to uint8
    gray = image_tensor(np.full((5, 6), 7, np.uint8))
    assert gray.shape == (3, 5, 6) and (gray == 7).all()
    assert torch.equal(bgr_to_tensor(np.ascontiguousarray(rgb[..., ::-1])), expected)


def test_bad_in_memory_images_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="HxWx3"):
        image_tensor(np.zeros((4, 4, 5), dtype=np.uint8))
    with pytest.raises(ValueError, match=r"Tensor\[3, H, W\]"):
        image_tensor(torch.zeros(1, 4, 4))
    with pytest.raises(TypeError, match="yolokit.predict"):
        image_tensor(tmp_path / "a.jpg")


def test_read_video_every_nth_frame_with_its_index(tmp_path):
    path = tmp_path / "v.avi"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 12.0, (32, 24))
    for i in range(7):
        writer.write(np.full((24, 32, 3), 30 * i, np.uint8))
    writer.release()
    frames = list(read_video(path, vid_stride=3))
    assert [f.index for f in frames] == [0, 3, 6] and {f.fps for f in frames} == {12.0}
    assert all(f.count == 7 and f.bgr.shape == (24, 32, 3) for f in frames)
    np.testing.assert_allclose([f.bgr.mean() for f in frames], [0, 90, 180], atol=2)  # MJPG: the frames' own greys
    with pytest.raises(ValueError, match="OpenCV cannot open video or stream .*missing.avi"):
        list(read_video(tmp_path / "missing.avi"))
