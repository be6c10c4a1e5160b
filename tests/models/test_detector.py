import math

import numpy as np
import pytest
import torch
from PIL import Image

import yolokit


def test_v8_decode_hand_case():
    model = yolokit.create_model("yolov8n", num_classes=2)
    maps = [torch.full((1, 66, 64 // s, 64 // s), -30.0) for s in (8, 16, 32)]  # a 64x64 input
    # at level 0, cell (x=2, y=1): put each side's mass on bin 3 (l), 1 (t), 2 (r), 0 (b)
    for side, b in enumerate((3, 1, 2, 0)):
        maps[0][0, side * 16 + b, 1, 2] = 30.0
    maps[0][0, 64 + 1, 1, 2] = math.log(0.8 / 0.2)  # class 1 score 0.8
    out = model.decode(maps)
    assert out.shape == (1, 64 + 16 + 4, 6)
    point = (2 + 0.5) * 8, (1 + 0.5) * 8
    expected = [point[0] - 3 * 8, point[1] - 1 * 8, point[0] + 2 * 8, point[1] + 0 * 8]
    torch.testing.assert_close(out[0, 1 * 8 + 2, :4], torch.tensor(expected), atol=1e-3, rtol=0)
    assert out[0, 1 * 8 + 2, 5].item() == pytest.approx(0.8, abs=1e-6)


@pytest.mark.parametrize("name", ["yolov8n", "yolov3-tiny"])
def test_decode_grids_follow_size_changes_and_serve_autograd_after_inference_mode(name):
    model = yolokit.create_model(name, num_classes=3).eval()
    fresh = yolokit.create_model(name, num_classes=3).eval()
    fresh.load_state_dict(model.state_dict())
    with torch.inference_mode():
        for size in (64, 96, 64):  # built, built anew, served from the cache
            x = torch.rand(1, 3, size, size)
            expected = fresh.decode(fresh(x))
            fresh.head._grids.store.clear()  # the reference always rebuilds
            torch.testing.assert_close(model.decode(model(x)), expected, rtol=0, atol=0)
    per_size = 1 if name == "yolov8n" else len(model.strides)  # DFL head: one entry for all levels
    assert len(model.head._grids.store) == 2 * per_size  # two input sizes; the third pass was served from the cache
    maps = [m.detach().requires_grad_() for m in model(torch.rand(1, 3, 64, 64))]  # grids made under inference_mode
    model.decode(maps).sum().backward()
    assert all(m.grad is not None and torch.isfinite(m.grad).all() for m in maps)


def test_v3_decode_hand_case():
    model = yolokit.create_model("yolov3-tiny", num_classes=1)
    maps = [torch.zeros(1, 18, 64 // s, 64 // s) for s in (16, 32)]
    # level 1 (stride 32), anchor 2 (344x319), cell (x=1, y=0): tx = ty = 0 -> centre of the cell
    a, c = 2, 6
    maps[1][0, a * c + 2, 0, 1] = math.log(0.5)  # w = 0.5 * 344
    maps[1][0, a * c + 4, 0, 1] = 10.0  # objectness ~1
    maps[1][0, a * c + 5, 0, 1] = math.log(0.25 / 0.75)  # class probability 0.25
    out = model.decode(maps)
    assert out.shape == (1, 3 * 16 + 3 * 4, 5)
    row = out[0, 3 * 16 + a * 4 + 0 * 2 + 1]
    cx, cy, w, h = 1.5 * 32, 0.5 * 32, 172.0, 319.0
    torch.testing.assert_close(row[:4], torch.tensor([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2]))
    assert row[4].item() == pytest.approx(0.25 / (1 + math.exp(-10)), abs=1e-5)


def test_v3_decode_clamps_sizes_as_the_loss_decodes_them():
    from yolokit.ops.anchors import MAX_LOG_SCALE

    model = yolokit.create_model("yolov3-tiny", num_classes=1)
    maps = [torch.zeros(1, 18, 64 // s, 64 // s) for s in (16, 32)]
    maps[1][0, 2 * 6 + 3, 0, 1] = 50.0  # t_h far past the clamp: exp(50) * 319 overflows float32
    row = model.decode(maps)[0, 3 * 16 + 2 * 4 + 1]
    assert torch.isfinite(row).all()
    assert (row[3] - row[1]).item() == pytest.approx(math.exp(MAX_LOG_SCALE) * 319, rel=1e-6)


def write_image(path, array):
    Image.fromarray(array).save(path)
    return path


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return yolokit.create_model("yolov8n", num_classes=3).eval()


def test_predict_takes_uint8_or_float_one_image_or_a_batch(model):
    image = torch.from_numpy(np.random.default_rng(0).integers(0, 255, (3, 64, 96), dtype=np.uint8))
    kwargs = dict(conf=0.0, max_det=20)
    ref = model.predict(image, **kwargs)[0]
    assert 0 < len(ref) <= 20 and ref.boxes.shape == (len(ref), 4)
    same = [
        model.predict(image.float() / 255, **kwargs)[0],
        model.predict(torch.stack([torch.zeros_like(image), image]), **kwargs)[1],
    ]
    for det in same:
        torch.testing.assert_close(det.boxes, ref.boxes, atol=1e-3, rtol=0)
        torch.testing.assert_close(det.scores, ref.scores)
        assert torch.equal(det.labels, ref.labels)
    assert (ref.boxes[:, 0::2] >= 0).all() and (ref.boxes[:, 0::2] <= 96).all()
    assert (ref.boxes[:, 1::2] >= 0).all() and (ref.boxes[:, 1::2] <= 64).all()
    assert model.training is False


def test_anything_but_a_tensor_is_refused_with_a_pointer_to_yolokit_predict(model, tmp_path):
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "img.png")
    for source in (str(tmp_path / "img.png"), tmp_path, np.zeros((32, 32, 3), np.uint8),
                   Image.open(tmp_path / "img.png"), [torch.zeros(3, 32, 32)]):
        with pytest.raises(TypeError, match=r"yolokit.predict\(model, source\)"):
            model.predict(source)
    with pytest.raises(ValueError, match=r"got shape \(32, 32, 3\)"):
        model.predict(torch.zeros(32, 32, 3))


def test_sides_off_the_stride_are_padded_grey_at_the_right_and_bottom(model):
    image = torch.rand(3, 50, 70, generator=torch.Generator().manual_seed(3))
    padded = torch.full((3, 64, 96), 114 / 255)
    padded[:, :50, :70] = image
    (got,) = model.predict(image, conf=0.0, max_det=10)
    (want,) = model.predict(padded, conf=0.0, max_det=10, orig_shapes=[(50, 70)], ratio_pad=[((1, 1), (0, 0))])
    assert torch.equal(got.boxes, want.boxes) and torch.equal(got.scores, want.scores)
    assert (got.boxes[:, 2] <= 70).all() and (got.boxes[:, 3] <= 50).all()  # clipped to the input, not the pad


def test_multi_label_keeps_a_box_once_per_class(model, monkeypatch):
    def fake_decode(maps):
        out = torch.zeros(1, 1, 7)
        out[0, 0, :4] = torch.tensor([10.0, 10.0, 30.0, 30.0])
        out[0, 0, 4:] = torch.tensor([0.9, 0.6, 0.1])
        return out

    monkeypatch.setattr(model, "decode", fake_decode)
    image = torch.zeros(3, 64, 64)
    assert model.predict(image, conf=0.25)[0].labels.tolist() == [0]
    (multi,) = model.predict(image, conf=0.25, multi_label=True)
    assert multi.labels.tolist() == [0, 1] and multi.scores.tolist() == pytest.approx([0.9, 0.6])


def test_class_names_default_to_indices_and_check_their_count():
    model = yolokit.create_model("yolov8n", num_classes=3)
    assert model.names == ["0", "1", "2"] and not model.has_names
    model.names = {0: "cat", 2: "emu"}
    assert model.names == ["cat", "1", "emu"] and model.has_names
    with pytest.raises(ValueError, match="3 classes but 4 names"):
        model.names = ["a", "b", "c", "d"]
    model.names = None
    assert not model.has_names


def test_predict_on_a_ready_batch_uses_metadata(model, monkeypatch):
    def fake_decode(maps):
        out = torch.zeros(2, 1, 7)
        out[:, 0, :4] = torch.tensor([20.0, 20.0, 40.0, 40.0])
        out[:, 0, 4] = 0.9
        return out

    monkeypatch.setattr(model, "decode", fake_decode)
    batch = torch.rand(2, 3, 64, 64)
    dets = model.predict(batch, orig_shapes=[(128, 128), (64, 64)],
                         ratio_pad=[((0.5, 0.5), (0.0, 0.0)), ((1.0, 1.0), (10.0, 0.0))])
    assert dets[0].boxes.tolist() == [[40, 40, 80, 80]]
    assert dets[1].boxes.tolist() == [[10, 20, 30, 40]]


def test_train_mode_is_restored_after_predict():
    model = yolokit.create_model("yolov3-tiny", num_classes=2).train()
    model.predict(torch.zeros(3, 32, 32, dtype=torch.uint8))
    assert model.training


def test_one_channels_last_rule_for_inference_and_training():
    from yolokit.models import prefers_channels_last
    from yolokit.train import TrainConfig
    from yolokit.train.plan import Processes, device_settings

    for device in ("cpu", "cuda"):
        procs = Processes(torch.device(device), rank=0, local_rank=0, world=1, local_world=1)
        assert device_settings(TrainConfig(), procs).channels_last == prefers_channels_last(device)
    fused = yolokit.create_model("yolov8n", num_classes=2).fuse()   # on the CPU
    weights = [p for p in fused.parameters() if p.ndim == 4]
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in weights) == prefers_channels_last("cpu")
