import numpy as np
import pytest
import torch
from PIL import Image

from yolokit.ops.images import image_files, letterbox, load_images, read_image, to_image_tensor


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


def test_inputs_of_every_kind(tmp_path):
    rgb = np.zeros((20, 30, 3), dtype=np.uint8)
    rgb[..., 0] = 200  # red
    Image.fromarray(rgb).save(tmp_path / "a.png")
    Image.fromarray(rgb).convert("L").save(tmp_path / "b.jpg")
    (tmp_path / "notes.txt").write_text("not an image")
    assert [p.name for p in image_files(tmp_path)] == ["a.png", "b.jpg"]
    from_file = read_image(tmp_path / "a.png")
    assert from_file.shape == (3, 20, 30) and from_file[0].max() == 200 and from_file[1].max() == 0
    assert read_image(tmp_path / "b.jpg").shape == (3, 20, 30)  # grayscale -> RGB
    assert torch.equal(to_image_tensor(rgb), from_file)
    assert torch.equal(to_image_tensor(Image.fromarray(rgb).convert("RGBA")), from_file)
    images, names = load_images([tmp_path, rgb, torch.zeros(2, 3, 8, 8)][:2])
    assert len(images) == 3 and names[:2] == [str(tmp_path / "a.png"), str(tmp_path / "b.jpg")]
    batch_images, _ = load_images(torch.zeros(2, 3, 8, 8))
    assert len(batch_images) == 2


def test_bad_inputs_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jpg"):
        load_images(tmp_path / "missing.jpg")
    with pytest.raises(FileNotFoundError, match="no images"):
        image_files(tmp_path)
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"\xff\xd8\xff not really a jpeg")
    with pytest.raises(ValueError, match="broken.jpg"):
        read_image(bad)
    with pytest.raises(ValueError, match="HxWx3"):
        to_image_tensor(np.zeros((4, 4, 5), dtype=np.uint8))
