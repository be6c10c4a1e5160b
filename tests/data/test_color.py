"""The HSV step on the device (`data.augment.color`) makes the images the loader's workers make (OpenCV)."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch

from yolokit.data import AugmentConfig, DetectionDataset, build_dataloader, collate, to_device
from yolokit.data.augment.color import _to_hsv, _to_rgb, apply_hsv_lut_batch
from yolokit.data.augment.transforms import apply_hsv_lut, hsv_lut
from yolokit.data.loader import collate_uint8


def _close_to_opencv(mine: np.ndarray, theirs: np.ndarray) -> float:
    """Share of pixels equal to OpenCV's; asserts every pixel within one level.

    Equal everywhere where OpenCV's float HSV-to-BGR uses FMA (x86 with AVX2, aarch64); a
    build that rounds the product separately differs by one level on ~0.015% of the inputs.
    """
    diff = np.abs(mine.astype(np.int16) - theirs.astype(np.int16)).max(-1)
    assert diff.max() <= 1
    equal = float((diff == 0).mean())
    assert equal > 0.999
    return equal


def test_bgr_to_hsv_is_opencvs_integer_arithmetic_on_every_colour():
    c = np.arange(1 << 24, dtype=np.uint32)
    bgr = np.stack([(c >> 16) & 255, (c >> 8) & 255, c & 255], -1).astype(np.uint8).reshape(4096, 4096, 3)
    planes = torch.from_numpy(bgr).to(torch.int32).unbind(-1)
    h, s, v = _to_hsv(planes[2], planes[1], planes[0])
    assert np.array_equal(torch.stack([h, s, v], -1).numpy().astype(np.uint8), cv2.cvtColor(bgr, cv2.COLOR_BGR2HSV))


def test_hsv_to_bgr_matches_opencv_on_every_hsv_triple():
    hue, sat, val = np.meshgrid(np.arange(180), np.arange(256), np.arange(256), indexing="ij")
    hsv = np.stack([hue, sat, val], -1).astype(np.uint8).reshape(180 * 256, 256, 3)
    r, g, b = _to_rgb(*torch.from_numpy(hsv).to(torch.int32).unbind(-1))
    _close_to_opencv(torch.stack([b, g, r], -1).numpy(), cv2.cvtColor(hsv, cv2.COLOR_HSV2BGR))


def test_batch_tables_match_the_workers_per_image():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (3, 96, 160, 3), np.uint8)           # BGR, a width of 5 strides
    images[1, :40] = 114                                               # grey padding: saturation 0
    luts = [hsv_lut(np.random.default_rng(k), h=0.5 * k, s=0.9, v=0.9) for k in range(3)]  # wrap-around, clipping
    batch = torch.from_numpy(images[..., ::-1].copy()).permute(0, 3, 1, 2).contiguous()   # RGB planes
    out = apply_hsv_lut_batch(batch, torch.from_numpy(np.stack(luts)))
    assert out.shape == batch.shape and out.dtype == torch.uint8
    for k in range(3):
        _close_to_opencv(out[k].permute(1, 2, 0).numpy()[..., ::-1], apply_hsv_lut(images[k], luts[k]))
    assert not torch.equal(out[0], out[1][:, :1].expand_as(out[0]))    # different tables, different images
    with pytest.raises(ValueError, match="luts must be uint8"):
        apply_hsv_lut_batch(batch, torch.from_numpy(np.stack(luts[:2])))
    with pytest.raises(ValueError, match="images must be uint8"):
        apply_hsv_lut_batch(batch.float(), torch.from_numpy(np.stack(luts)))


@pytest.mark.parametrize("rect", [False, True], ids=["mosaic", "rect"])
def test_loader_on_device_hsv_gives_the_workers_batches(shapes_yaml, rect):
    """Mosaic (and MixUp) or rect batches: to_device with the tables gives the batch the workers would give."""
    hyp = AugmentConfig(mixup=0.5)

    def batches(on_device: bool, workers: int) -> list[tuple[dict, dict]]:
        ds = DetectionDataset(shapes_yaml, "train", imgsz=96, augment=True, hyp=hyp, buffer_size=0)
        loader = build_dataloader(ds, 5, workers=workers, seed=3, uint8_images=True, hsv_on_device=on_device,
                                  rect=rect, persistent_workers=False)
        return [(b, to_device(b, "cpu")) for b in loader]

    deferred, made = batches(True, 2), batches(False, 0)
    assert len(deferred) == len(made) == 5                              # 24 images: 4 of 5, one of 4
    for (raw, out), (raw_w, out_w) in zip(deferred, made, strict=True):
        n = len(raw["indices"])
        assert raw["hsv_lut"].shape == (n, 3, 256) and "hsv_lut" not in raw_w and "hsv_lut" not in out
        assert not torch.equal(raw["images_uint8"], raw_w["images_uint8"])   # the workers left HSV out
        assert raw["indices"] == raw_w["indices"] and torch.equal(out["targets"], out_w["targets"])
        mine = (out["images"] * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
        theirs = raw_w["images_uint8"].permute(0, 2, 3, 1).numpy()
        _close_to_opencv(mine, theirs)
        assert out["images"].dtype == torch.float32 and out["images"].max() <= 1


def test_tables_need_uint8_batches(shapes_yaml):
    ds = DetectionDataset(shapes_yaml, "train", imgsz=64, augment=True)
    with pytest.raises(ValueError, match="hsv_on_device needs uint8_images"):
        build_dataloader(ds, 2, workers=0, hsv_on_device=True)
    build_dataloader(ds, 2, workers=0, uint8_images=True, hsv_on_device=True)
    items = [ds[0], ds[1]]
    assert items[0]["hsv_lut"].shape == (3, 256)
    with pytest.raises(ValueError, match="need collate_uint8"):
        collate(items)
    assert collate_uint8(items)["hsv_lut"].shape == (2, 3, 256)
    build_dataloader(ds, 2, workers=0)                                  # a loader without it: HSV in the workers again
    assert "hsv_lut" not in ds[0]


@pytest.mark.gpu
def test_cuda_makes_the_cpus_images_bit_for_bit():
    """On the GPU: every colour through three tables as on the CPU (IEEE float32 and float64 there too)."""
    c = torch.arange(1 << 24, dtype=torch.int64)
    rgb = torch.stack([(c >> 16) & 255, (c >> 8) & 255, c & 255]).to(torch.uint8).reshape(1, 3, 4096, 4096)
    rng = np.random.default_rng(0)
    luts = torch.from_numpy(np.stack([hsv_lut(rng), hsv_lut(rng, h=0.5, s=0.9, v=0.9), hsv_lut(rng)]))
    images = rgb.expand(3, -1, -1, -1).contiguous()
    on_cpu = apply_hsv_lut_batch(images, luts)
    on_gpu = apply_hsv_lut_batch(images.cuda(), luts.cuda())
    assert torch.equal(on_gpu.cpu(), on_cpu)
