"""The device augmentation (augment_on="device"): the workers path's labels exactly, its images
within a grey level, one batched pass whose kernel count does not grow with the batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from yolokit.data import AugmentConfig, DetectionDataset, build_dataloader, to_device
from yolokit.data.augment.device_augment import augment_batch

NO_HSV = dict(hsv_h=0.0, hsv_s=0.0, hsv_v=0.0)
CASES = {
    "mosaic": {},
    "no-mosaic": dict(mosaic=0.0),
    "rotate-shear-perspective-flipud": dict(degrees=10.0, shear=2.0, perspective=0.001, flipud=0.5),
    "mixup": dict(mixup=1.0),
}


def _batches(yaml, augment_on, *, seed=0, batch=8, imgsz=64, hyp=None, epochs=1, **kw):
    """The first batch of each epoch (and the dataset), `workers` or `device`."""
    loader_kw = {k: kw.pop(k) for k in ("rect", "workers") if k in kw}
    ds = DetectionDataset(yaml, "train", imgsz=imgsz, augment=True, hyp=AugmentConfig(**(hyp or {})), **kw)
    loader = build_dataloader(ds, batch, workers=loader_kw.pop("workers", 0), seed=seed, uint8_images=True,
                              augment_on=augment_on, **loader_kw)
    return [next(iter(loader)) for _ in range(epochs)], ds


def _compare(a: dict, b: dict, *, mean_levels: float) -> torch.Tensor:
    """Labels equal, images within `mean_levels` grey levels per image; returns |difference| per pixel."""
    assert torch.equal(a["targets"], b["targets"])                   # boxes, classes, the ones dropped
    assert a["indices"] == b["indices"] and a["ratio_pad"] == b["ratio_pad"] and a["max_boxes"] == b["max_boxes"]
    images = augment_batch(b, "cpu")
    assert images.dtype == torch.uint8 and images.shape == a["images_uint8"].shape
    diff = (images.int() - a["images_uint8"].int()).abs()
    per_image = diff.float().mean((1, 2, 3))
    assert per_image.max() <= mean_levels, per_image.tolist()
    return diff


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_same_labels_and_images_within_a_grey_level(shapes_yaml, case, seed):
    (a,), _ = _batches(shapes_yaml, "workers", seed=seed, hyp=CASES[case])
    (b,), _ = _batches(shapes_yaml, "device", seed=seed, hyp=CASES[case])
    diff = _compare(a, b, mean_levels=1.0)
    # single pixels move more only where the HSV hue of a saturated colour crosses a sector
    assert (diff > 2).float().mean() < 0.04


@pytest.mark.parametrize("cache", ["ram", "disk"])
def test_geometry_matches_opencv_to_rounding(shapes_yaml, cache, tmp_path):
    # decoded by OpenCV in both (the cache's images), no HSV: the Mosaic, warp, paste and flips differ
    # by OpenCV's fixed-point rounding only (one level), and a pure paste at scale 1 is exact
    caching = dict(cache_images=cache, cache_dir=tmp_path / "cache") if cache == "disk" else dict(cache_images=cache)
    (a,), _ = _batches(shapes_yaml, "workers", hyp=NO_HSV, **caching)
    (b,), _ = _batches(shapes_yaml, "device", hyp=NO_HSV, **caching)
    assert b["aug_jpeg"].numel() == 0 and b["aug_pixels"].shape[1] > 0         # the workers' decoded images
    diff = _compare(a, b, mean_levels=0.3)
    assert diff.max() <= 1
    still = dict(NO_HSV, mosaic=0.0, scale=0.0, translate=0.0)
    (a,), _ = _batches(shapes_yaml, "workers", hyp=still, imgsz=128)
    (b,), _ = _batches(shapes_yaml, "device", hyp=still, imgsz=128)
    assert _compare(a, b, mean_levels=0.0).max() == 0


def test_jpeg_decode_and_resize_within_two_levels(shapes_yaml):
    # the files decoded by torchvision's libjpeg-turbo, resized 128 -> 64 here: two levels at most
    (a,), _ = _batches(shapes_yaml, "workers", hyp=NO_HSV)
    (b,), _ = _batches(shapes_yaml, "device", hyp=NO_HSV)
    assert b["aug_jpeg"].numel() > 0 and b["aug_pixels"].shape[1] == 0        # the device decoded every image
    assert _compare(a, b, mean_levels=0.4).max() <= 2


def test_turned_and_other_files_are_decoded_by_the_workers(tmp_path):
    from PIL import Image

    from .conftest import draw_rects, write_yolo_dataset

    image = draw_rects((48, 64), [(8, 8, 40, 30), (44, 20, 60, 44)])
    label = "0 0.375 0.396 0.5 0.458\n1 0.8125 0.667 0.25 0.5\n"
    yaml = write_yolo_dataset(tmp_path / "set", {"a.png": (image, label), "b.jpg": (image, label),
                                                 "c.jpg": (None, label)})
    exif = Image.Exif()
    exif[0x0112] = 6                                                    # turned a quarter: upright 64 x 48
    Image.fromarray(image[..., ::-1]).save(tmp_path / "set/images/train/c.jpg", exif=exif, quality=95)
    (a,), ds = _batches(yaml, "workers", batch=3, seed=1, buffer_size=0, hyp=dict(mosaic=0.0))
    (b,), _ = _batches(yaml, "device", batch=3, seed=1, buffer_size=0, hyp=dict(mosaic=0.0))
    assert sorted(ds.shapes.tolist()) == [[48, 64], [48, 64], [64, 48]]
    kinds = sorted(b["aug_sources"][:, 0].tolist())
    assert kinds == [0, 1, 1]                                           # only b.jpg's bytes go to the device
    _compare(a, b, mean_levels=1.0)


def test_rect_batches(shapes_yaml):
    loaders = []
    for augment_on in ("workers", "device"):
        ds = DetectionDataset(shapes_yaml, "train", imgsz=128, augment=True)
        loaders.append(build_dataloader(ds, 4, workers=0, seed=3, uint8_images=True, rect=True, augment_on=augment_on))
    shapes = set()
    for a, b in zip(*loaders, strict=True):
        shapes.add(tuple(a["images_uint8"].shape[2:]))
        _compare(a, b, mean_levels=1.0)
    assert len(shapes) > 1 and any(h != w for h, w in shapes)            # batch shapes, not one square


def test_close_mosaic_switches_the_device_path_too(shapes_yaml):
    ds_a = DetectionDataset(shapes_yaml, "train", imgsz=64, augment=True)
    ds_b = DetectionDataset(shapes_yaml, "train", imgsz=64, augment=True)
    la = build_dataloader(ds_a, 8, workers=0, seed=5, uint8_images=True)
    lb = build_dataloader(ds_b, 8, workers=0, seed=5, uint8_images=True, augment_on="device")
    first = next(iter(lb))
    assert (first["aug_frame"][:, 0, 0] == 128).all()                  # Mosaic: the 2 * imgsz canvas
    next(iter(la))
    ds_a.mosaic = ds_b.mosaic = False                                  # what the trainer does for the last epochs
    a, b = next(iter(la)), next(iter(lb))
    assert (b["aug_frame"][:, 0, 0] == 64).all() and (b["aug_tiles"][:, 0, 1:, 0] == -1).all()   # one tile
    _compare(a, b, mean_levels=1.0)


def test_multi_scale_after_the_pass(shapes_yaml):
    from yolokit.train.scales import MultiScale

    (a,), _ = _batches(shapes_yaml, "workers", seed=4)
    (b,), _ = _batches(shapes_yaml, "device", seed=4)
    scale = MultiScale(64, 32, seed=0)
    step = next(s for s in range(50) if scale.size(0, s) != 64)           # a step whose size is not imgsz
    ia, ta = scale(to_device(a, "cpu")["images"], a["targets"], 0, step)
    ib, tb = scale(to_device(b, "cpu")["images"], b["targets"], 0, step)
    assert ia.shape == ib.shape and ia.shape[-1] != 64 and torch.equal(ta, tb)
    assert ((ia - ib).abs().mean((1, 2, 3)) * 255).max() <= 1.0


def test_resume_mid_epoch_gives_the_same_recipes(shapes_yaml):
    # buffer_size=0: Mosaic partners from the whole set (with the recent-image buffer a resumed epoch
    # draws partners among other images, on both paths alike)
    ds = DetectionDataset(shapes_yaml, "train", imgsz=64, augment=True, hyp=AugmentConfig(mixup=0.5), buffer_size=0)
    loader = build_dataloader(ds, 4, workers=0, seed=7, uint8_images=True, augment_on="device")
    loader.set_epoch(2)
    full = list(loader)
    loader.set_epoch(2, start_step=3)
    resumed = list(loader)
    assert len(resumed) == len(full) - 3
    for x, y in zip(full[3:], resumed, strict=True):
        assert torch.equal(x["targets"], y["targets"]) and np.array_equal(x["aug_inverse"], y["aug_inverse"])
        assert torch.equal(x["hsv_lut"], y["hsv_lut"]) and np.array_equal(x["aug_mix"], y["aug_mix"])
        assert torch.equal(augment_batch(x, "cpu"), augment_batch(y, "cpu"))


def test_worker_processes_ship_the_same_recipes(shapes_yaml):
    (a,), _ = _batches(shapes_yaml, "device", seed=2, workers=0)
    (b,), _ = _batches(shapes_yaml, "device", seed=2, workers=2)
    assert torch.equal(a["targets"], b["targets"]) and torch.equal(a["aug_jpeg"], b["aug_jpeg"])
    assert torch.equal(augment_batch(a, "cpu"), augment_batch(b, "cpu"))


def test_to_device_gives_the_batch_contract(shapes_yaml):
    (b,), _ = _batches(shapes_yaml, "device")
    out = to_device(b, "cpu")
    assert out["images"].dtype == torch.float32 and out["images"].shape == (8, 3, 64, 64)
    assert out["images"].min() >= 0 and out["images"].max() <= 1
    assert not any(k.startswith("aug_") for k in out) and "hsv_lut" not in out
    assert set(out) >= {"images", "targets", "paths", "orig_shapes", "ratio_pad", "indices", "max_boxes"}


def test_refuses_what_it_cannot_do(shapes_yaml):
    ds = DetectionDataset(shapes_yaml, "train", imgsz=64, augment=True)
    with pytest.raises(ValueError, match="augment_on must be"):
        build_dataloader(ds, 2, workers=0, augment_on="gpu")
    ds.albumentations = object()
    with pytest.raises(ValueError, match="albumentations"):
        build_dataloader(ds, 2, workers=0, augment_on="device")
    val = DetectionDataset(shapes_yaml, "val", imgsz=64)                  # nothing to augment: workers as before
    batch = next(iter(build_dataloader(val, 2, workers=0, uint8_images=True, augment_on="device")))
    assert "images_uint8" in batch and "aug_tiles" not in batch


class _Count(TorchDispatchMode):
    """Counts the kernels (aten ops that are neither views nor bare allocations) run under it.

    ``aten.empty`` launches nothing; torchvision 0.26's CPU JPEG decoder (the GPU machine's)
    allocates each image's output through it, where 0.29's does not."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        aliases = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        allocation = func.overloadpacket in (torch.ops.aten.empty, torch.ops.aten.empty_strided)
        if func.namespace == "aten" and not aliases and not allocation:
            self.kernels += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("parts", [2, 3])
def test_a_batch_split_after_running_out_of_memory_makes_the_same_images(shapes_yaml, parts):
    # the Accumulator's replay cuts a loader batch into micro-batches (3 of 8 images: 3, 3, 2): the
    # per-image recipes are cut, the sources they point into stay whole in each
    from yolokit.accel.split import SHARED_KEYS, batch_len, split_batch

    (b,), _ = _batches(shapes_yaml, "device", hyp=dict(mixup=0.5))
    whole = to_device(b, "cpu")
    micro = split_batch(b, parts)
    assert batch_len(b) == 8 and [batch_len(m) for m in micro] == [8 // parts + (i < 8 % parts) for i in range(parts)]
    assert all(m[k] is b[k] for m in micro for k in SHARED_KEYS)
    made = [to_device(m, "cpu") for m in micro]
    assert torch.equal(torch.cat([m["images"] for m in made]), whole["images"])
    at, labels = 0, []
    for m in made:
        rows = m["targets"].clone()
        rows[:, 0] += at
        labels.append(rows)
        at += len(m["images"])
    assert torch.equal(torch.cat(labels), whole["targets"])


def _own_set(tmp_path):
    from yolokit.data import make_shapes

    return make_shapes(tmp_path / "set", seed=0, n_train=16, n_val=2, imgsz=128)


def test_a_jpeg_cut_short_since_indexing_is_left_to_the_workers(tmp_path, caplog):
    # a file cut short after the index was made: the device path does what the workers path does
    # (here neither decoder can read it: another image is used, with the same labels on both paths)
    yaml = _own_set(tmp_path)
    paths = sorted((yaml.parent / "images" / "train").glob("*.jpg"))
    sets = [DetectionDataset(yaml, "train", imgsz=64, augment=True) for _ in range(2)]   # indexed while whole
    cut = paths[3]
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    loaders = [build_dataloader(ds, 8, workers=0, seed=0, uint8_images=True, augment_on=where)
               for ds, where in zip(sets, ("workers", "device"), strict=True)]
    with caplog.at_level("WARNING", logger="yolokit.data"):
        a, b = (next(iter(loader)) for loader in loaders)
    assert str(cut) not in b["aug_files"] and len(b["aug_files"]) > 0      # not sent to the device's decoder
    assert f"excluded at run time: {cut}" in caplog.text
    _compare(a, b, mean_levels=1.0)                                  # the same labels, images within a level


def test_a_jpeg_the_device_rejects_is_decoded_on_the_host_and_named(tmp_path, caplog):
    import cv2

    yaml = _own_set(tmp_path)
    (b,), _ = _batches(yaml, "device", hyp=NO_HSV)
    name = b["aug_files"][0]
    rows = [r for r in b["aug_sources"].tolist() if r[0] == 0]
    start, end = rows[0][1], rows[1][1]
    data = b["aug_jpeg"][start:end].clone()
    good = augment_batch(b, "cpu")
    middle = start + (end - start) // 2          # a marker libjpeg-turbo refuses inside the image data;
    b["aug_jpeg"][middle:middle + 2] = torch.tensor([0xFF, 0x1C], dtype=torch.uint8)   # its end marker stays
    with caplog.at_level("WARNING", logger="yolokit.data"):
        damaged = augment_batch(b, "cpu")
        again = augment_batch(b, "cpu")
    assert damaged.shape == good.shape and torch.equal(damaged, again)
    assert caplog.text.count(name) == 1 and "decoded by OpenCV on the host instead" in caplog.text
    assert cv2.imdecode(data.numpy(), cv2.IMREAD_COLOR) is not None
    unchanged = [i for i in range(len(good)) if torch.equal(good[i], damaged[i])]
    assert 0 < len(unchanged) < len(good)           # only the images drawn from that file changed


@pytest.mark.parametrize("cached", [False, True], ids=["jpeg", "ram-cache"])
def test_kernel_count_does_not_grow_with_the_batch(shapes_yaml, cached):
    hyp = dict(mixup=0.5)
    counts = {}
    for n in (8, 64):
        batch = _batches(shapes_yaml, "device", batch=n, hyp=hyp, cache_images="ram" if cached else False)[0][0]
        assert len(batch["indices"]) == min(n, 24) and bool((batch["aug_mix"] < 1).any())
        augment_batch(batch, "cpu")                                    # once first: the HSV tables are built once
        with _Count() as count:
            augment_batch(batch, "cpu")
        counts[n] = count.kernels
    # the same kernels for 8 and 64 images: the count grows with the chunks of CHUNK pixels the resize
    # and the warp are cut into (one each here), never per image; views (the decode list's per-image
    # reshape) are free; the decode is not an aten op (on the CPU torchvision decodes file by file
    # in Python, on CUDA the list goes to nvJPEG in one call)
    assert counts[8] == counts[64] < 500, counts


@pytest.mark.gpu
def test_the_pass_never_syncs_on_cuda_and_makes_the_cpu_pass_images(shapes_yaml, monkeypatch):
    """On CUDA the pass waits for nothing under ``set_sync_debug_mode("error")``; fed the same decoded
    pixels, it makes the CPU pass's images; and what differs is nvJPEG's decode alone.

    Measured on an H200 (torch 2.11.0+cu130, torchvision 0.26, 2026-11-27), mean levels per image:
    the pass's arithmetic on CUDA against the CPU's, on the same pixels, 0.000; nvJPEG's decode of the
    batch's files against torchvision's CPU decode of the same files (libjpeg-turbo), 1.170 over all
    their pixels; the whole CUDA pass against the CPU pass, at most 1.204, and against the workers'
    OpenCV images at most 1.327 (the first H100 run: 1.33). So nvJPEG alone accounts for the
    difference, and the one-level bound of the device path against the workers holds with the
    decoder held equal: the pass on CUDA fed torchvision's CPU decode. nvJPEG's own difference is
    bounded at 1.5 levels (a wrong image, from a race or a bad index, is tens of levels off)."""
    from yolokit.data.augment import device_augment as da

    (b,), _ = _batches(shapes_yaml, "device", hyp=dict(mixup=0.5))
    (a,), _ = _batches(shapes_yaml, "workers", hyp=dict(mixup=0.5))
    augment_batch(b, "cuda")                                           # warm: nvJPEG, tables
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        images = augment_batch(b, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    cpu = augment_batch(b, "cpu")

    def mean_levels(x, y):
        return (x.cpu().int() - y.cpu().int()).abs().float().mean(tuple(range(1, x.dim())))

    decode = mean_levels(da.decode_sources(b, "cuda")[0][None], da.decode_sources(b, "cpu")[0][None])
    real = da._decode
    monkeypatch.setattr(da, "_decode", lambda files, rows, names, device: [
        im.to(device) for im in real(files, rows, names, torch.device("cpu"))])
    same_pixels = augment_batch(b, "cuda")                             # fed torchvision's CPU decode
    arithmetic, held_equal = mean_levels(same_pixels, cpu), mean_levels(same_pixels, a["images_uint8"])
    whole = mean_levels(images, cpu)
    print(f"mean levels per image: decode alone (nvJPEG vs CPU) {decode.item():.3f}; arithmetic (CUDA vs CPU, "
          f"same pixels) max {arithmetic.max():.3f}; CUDA pass vs CPU pass max {whole.max():.3f}; vs workers "
          f"max {mean_levels(images, a['images_uint8']).max():.3f}; CPU-decoded pass on CUDA vs workers max "
          f"{held_equal.max():.3f}")
    assert arithmetic.max() <= 0.05, arithmetic.tolist()
    assert held_equal.max() <= 1.0, held_equal.tolist()
    assert decode.item() <= 1.5 and whole.max() <= 1.5, (decode.item(), whole.tolist())


@pytest.mark.gpu
def test_the_decoder_never_writes_memory_queued_kernels_still_read(shapes_yaml):
    """The H100's random device-side assert, reproduced on purpose: the current stream is held back (a
    sleep kernel), kernels that read tensors of the decoded images' sizes are queued behind it, the
    tensors are freed (their blocks free for the current stream's next allocations of those sizes), and
    the pass runs at once. If the decoder wrote into those blocks before the queued kernels ran, their
    sums would be wrong; the pass's own stream keeps its blocks apart. Its images stay the same too."""
    (b,), _ = _batches(shapes_yaml, "device", batch=16, imgsz=128, hyp=dict(mixup=0.5))
    sizes = [3 * r[2] * r[3] for r in b["aug_sources"].tolist() if r[0] == 0]     # decoded JPEGs' bytes
    assert sizes
    first = augment_batch(b, "cuda").clone()
    for attempt in range(10):
        held = [torch.ones(n, dtype=torch.uint8, device="cuda") for n in sizes]
        torch.cuda._sleep(50_000_000)                              # tens of ms: what follows is still queued
        sums = torch.stack([t.sum(dtype=torch.int64) for t in held])
        del held                                                   # freed while the sums still wait to read them
        images = augment_batch(b, "cuda")
        assert sums.tolist() == sizes, attempt
        assert torch.equal(images, first), attempt


def test_only_jpegs_whose_exif_turns_them_are_decoded_in_the_workers():
    import io

    from PIL import Image

    from yolokit.data.augment.recipes import _has_exif, _turned

    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 64, 3), np.uint8))

    def jpeg(orientation=None):
        out, exif = io.BytesIO(), Image.Exif()
        if orientation is None:
            image.save(out, "JPEG")
        else:
            exif[0x0112] = orientation
            image.save(out, "JPEG", exif=exif)
        return np.frombuffer(out.getvalue(), np.uint8)

    plain, upright, turned = jpeg(), jpeg(1), jpeg(6)
    assert [_has_exif(plain), _has_exif(upright), _has_exif(turned)] == [False, True, True]
    assert [_turned(plain), _turned(upright), _turned(turned)] == [False, False, True]
    assert _has_exif(turned[:12])       # cut inside its headers: Pillow decides (and the workers decode it)
