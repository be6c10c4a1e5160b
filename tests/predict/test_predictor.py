"""predict_iter / predict: letterboxed batches, equality with Detector.predict, streaming, constant memory."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import yolokit
from yolokit.data.sources.images import letterbox
from yolokit.predict import batches, predict, predict_iter
from yolokit.predict.predictor import letterbox_batch, read_ahead


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    model = yolokit.create_model("yolov8n", num_classes=3).eval()
    model.names = ["cat", "dog", "emu"]
    return model


def test_batches_and_read_ahead():
    assert list(batches(range(7), 3)) == [[0, 1, 2], [3, 4, 5], [6]]
    with pytest.raises(ValueError, match="batch must be >= 1"):
        list(batches(range(3), 0))
    assert list(read_ahead(iter(range(5)))) == [0, 1, 2, 3, 4]

    def failing():
        yield 1
        raise ValueError("cannot read image z.jpg")

    with pytest.raises(ValueError, match="z.jpg"):  # errors of the reading thread reach the caller
        list(read_ahead(failing()))


def test_letterbox_batch_is_a_rectangle_for_one_shape_a_square_for_mixed():
    wide = torch.full((3, 100, 200), 7, dtype=torch.uint8)
    batch, pads = letterbox_batch([wide, wide], 60, 32)  # 60 rounds up to 64
    assert batch.shape == (2, 3, 32, 64) and batch.dtype == torch.uint8 and pads[0] == ((0.32, 0.32), (0.0, 0.0))
    assert (batch[:, :, :, :] == 7).all()  # 32x64 content fills the rectangle exactly
    mixed, pads = letterbox_batch([wide, torch.zeros(3, 50, 50, dtype=torch.uint8)], 64, 32)
    assert mixed.shape == (2, 3, 64, 64) and pads == [((0.32, 0.32), (0.0, 16.0)), ((1.28, 1.28), (0.0, 0.0))]
    assert (mixed[0, :, :16] == 114).all() and (mixed[0, :, 16:48] == 7).all() and (mixed[0, :, 48:] == 114).all()


def test_results_equal_detector_predict_on_the_letterboxed_images_whatever_the_batch(model, tmp_path, write_image):
    images = [write_image(tmp_path / f"{i}.png", h=48, w=64, seed=i) for i in range(5)]
    kwargs = dict(conf=0.0, max_det=7)
    expected = []
    for rgb in images:
        boxed, ratio_pad = letterbox(rgb, 64, stride=32, auto=True)  # 48x64 -> 64x64 (rect of one shape)
        assert boxed.shape == (64, 64, 3)
        expected += model.predict(torch.from_numpy(boxed).permute(2, 0, 1), orig_shapes=[(48, 64)],
                                  ratio_pad=[ratio_pad], **kwargs)
    for batch in (1, 2, 5):
        got = list(predict_iter(model, tmp_path, batch=batch, imgsz=64, **kwargs))
        assert [r.name for r in got] == [f"{i}.png" for i in range(5)]
        for r, e in zip(got, expected, strict=True):
            torch.testing.assert_close(r.boxes, e.boxes.cpu())
            torch.testing.assert_close(r.scores, e.scores.cpu())
            assert torch.equal(r.labels, e.labels) and r.orig_shape == (48, 64) and r.names == model.names
            assert r.boxes.device.type == "cpu" and len(r) == 7


def test_boxes_come_back_in_original_pixels_for_every_in_memory_kind(model, monkeypatch):
    from PIL import Image

    # 90x200 at imgsz 64: ratio 0.32 -> 29x64 content, padded to 32x64 (1 px on top)
    def fake_decode(maps):
        out = torch.zeros(len(maps[0]), 1, 7)
        out[:, 0, :4] = torch.tensor([0.0, 1.0, 32.0, 30.0])
        out[:, 0, 4] = 0.9
        return out

    monkeypatch.setattr(model, "decode", fake_decode)
    rgb = np.random.default_rng(0).integers(0, 255, (90, 200, 3), dtype=np.uint8)
    as_tensor = torch.from_numpy(rgb).permute(2, 0, 1)
    for source in (rgb, Image.fromarray(rgb), as_tensor, as_tensor.float() / 255, [rgb, rgb],
                   np.ascontiguousarray(rgb[..., ::-1])[..., ::-1]):  # a negative-stride view
        for r in predict(model, source, imgsz=64):
            torch.testing.assert_close(r.boxes, torch.tensor([[0.0, 0.0, 100.0, 90.0]]), atol=0.5, rtol=0)
            assert r.orig_shape == (90, 200) and torch.equal(r.image, as_tensor)
    # mixed sizes share one 64x64 batch, each mapped back through its own letterbox:
    # 40x60 -> ratio 64/60 (43x64, 10 px on top); 64x30 -> ratio 1 (17 px on the left)
    small, tall = predict(model, [np.zeros((40, 60, 3), np.uint8), np.zeros((64, 30, 3), np.uint8)], imgsz=64,
                          batch=2)
    assert small.orig_shape == (40, 60) and tall.orig_shape == (64, 30)
    torch.testing.assert_close(small.boxes, torch.tensor([[0.0, 0.0, 30.0, 20 * 40 / 43]]), atol=1e-4, rtol=0)
    torch.testing.assert_close(tall.boxes, torch.tensor([[0.0, 1.0, 15.0, 30.0]]), atol=1e-4, rtol=0)


def test_one_result_per_video_frame(model, tmp_path, write_video):
    video = write_video(tmp_path / "v.avi", frames=9, fps=10.0)
    got = list(predict_iter(model, video, imgsz=64, batch=4, conf=0.0, max_det=2))
    assert [r.frame for r in got] == list(range(9)) and {r.fps for r in got} == {10.0}
    assert all(r.orig_shape == (48, 64) and len(r) == 2 for r in got)


def test_predict_streams_lazily_and_saves(model, tmp_path, write_image):
    for i in range(3):
        write_image(tmp_path / "in" / f"{i}.jpg", seed=i)
    stream = predict(model, tmp_path / "in", stream=True, out=tmp_path / "run", save_txt=True, imgsz=64,
                     conf=0.0, max_det=2)
    assert not (tmp_path / "run" / "labels").exists()  # nothing runs before iteration
    first = next(stream)
    assert first.name == "0.jpg" and (tmp_path / "run" / "labels" / "0.txt").is_file()
    rest = list(stream)
    assert len(rest) == 2 and (tmp_path / "run" / "2.jpg").is_file()
    listed = predict(model, [np.zeros((30, 40, 3), np.uint8)] * 2, imgsz=64, conf=0.0, max_det=1)
    assert isinstance(listed, list) and [r.name for r in listed] == ["image0.jpg", "image1.jpg"]


PEAK = textwrap.dedent("""
    import sys, torch, yolokit
    from yolokit.predict import predict_iter
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = yolokit.create_model("yolov8n", num_classes=1).eval().fuse()
    count = sum(1 for _ in predict_iter(model, sys.argv[1], imgsz=128, batch=8, conf=0.5))
    peak = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
    print(count, int(peak) / 1024)
""")


@pytest.mark.slow
@pytest.mark.extended   # the images streamed in batches, never stacked: test_predict_streams_lazily_and_saves
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmHWM from /proc")
def test_peak_memory_does_not_grow_with_the_folder(tmp_path):
    """40 vs 200 images of 128x128: stacking them all (the old way) would add ~40 MB (uint8 + float
    letterboxed copies of 160 more images); streaming in batches of 8 adds nothing."""
    import cv2

    rng = np.random.default_rng(0)
    for i in range(200):
        folder = tmp_path / ("small" if i < 40 else "more")
        folder.mkdir(exist_ok=True)
        cv2.imwrite(str(folder / f"{i:04d}.jpg"), rng.integers(0, 255, (128, 128, 3), dtype=np.uint8))
    (tmp_path / "all").mkdir()
    for p in list((tmp_path / "small").iterdir()) + list((tmp_path / "more").iterdir()):
        (tmp_path / "all" / p.name).symlink_to(p)
    peaks = {}
    for name, count in (("small", 40), ("all", 200)):
        out = subprocess.run([sys.executable, "-c", PEAK, str(tmp_path / name)], capture_output=True, text=True,
                             check=True).stdout.split()
        assert int(out[0]) == count
        peaks[count] = float(out[1])
    print(f"peak RSS: 40 images {peaks[40]:.1f} MB, 200 images {peaks[200]:.1f} MB")
    assert abs(peaks[200] - peaks[40]) < 12, peaks


def test_a_segmentation_models_results_keep_masks_in_their_boxes_until_read(tmp_path):
    """predict asks a segmentation model for its masks as crops: each result holds ``MaskCrops`` (the memory of
    its boxes) and gives the masks ``Detector.predict`` gives whole, when read; ``--save-txt`` rows from them."""
    import dataclasses

    from _models import TINY_SEG, lively

    from yolokit.ops.masks import MaskCrops

    torch.manual_seed(0)
    seg = lively(yolokit.create_model(TINY_SEG, num_classes=3)).eval()
    rng = np.random.default_rng(0)
    images = [torch.from_numpy(rng.integers(0, 255, (3, h, w), dtype=np.uint8)) for h, w in ((90, 140), (64, 64))]
    results = predict(seg, images, imgsz=96, conf=0.0, max_det=5)
    assert [len(r) for r in results] == [5, 5]
    filled = 0
    for image, r in zip(images, results, strict=True):
        assert isinstance(r.__dict__["_masks"], MaskCrops)
        lines = r.txt_lines()
        boxed, ratio_pad = letterbox_batch([image], 96, 32)
        want = seg.predict(boxed, orig_shapes=[tuple(image.shape[-2:])], ratio_pad=ratio_pad, conf=0.0, max_det=5)[0]
        assert torch.equal(r.masks, want.masks) and r.masks.shape == (5, *image.shape[-2:])
        filled += int(r.masks.flatten(1).any(1).sum())
        assert lines == dataclasses.replace(r, masks=want.masks).txt_lines()
    assert filled >= 2                                                  # outlines of real masks, not boxes
