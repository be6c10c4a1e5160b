"""Dataset items, collate, samplers and build_dataloader."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch

from yolokit.data import (
    AugmentConfig,
    DetectionDataset,
    build_dataloader,
    collate,
    to_device,
)

from .conftest import COLOURS, draw_rects, write_yolo_dataset


def _batches(loader, n=None):
    out = []
    for k, batch in enumerate(loader):
        if n is not None and k >= n:
            break
        out.append(batch)
    return out


def _same(a, b) -> bool:
    return (a["images"].shape == b["images"].shape and torch.equal(a["images"], b["images"])
            and torch.equal(a["targets"], b["targets"]) and a["paths"] == b["paths"])


def _back_to_original(targets, ratio_pad):
    (rw, rh), (pw, ph) = ratio_pad
    return (targets[:, 2:] - torch.tensor([pw, ph, pw, ph])) / torch.tensor([rw, rh, rw, rh])


def test_batch_contract_and_ratio_pad(shapes_yaml):
    ds = DetectionDataset(shapes_yaml, "val", imgsz=96)
    batch = next(iter(build_dataloader(ds, 5, workers=0)))
    assert set(batch) >= {"images", "targets", "paths", "orig_shapes", "ratio_pad"}
    images, targets = batch["images"], batch["targets"]
    assert images.shape == (5, 3, 96, 96) and images.dtype == torch.float32
    assert images.min() >= 0 and images.max() <= 1 and images.max() > 0.5
    assert targets.dtype == torch.float32 and targets.shape[1] == 6 and len(targets) > 0
    assert set(targets[:, 0].long().tolist()) <= set(range(5))
    assert ((targets[:, 1] >= 0) & (targets[:, 1] < 4)).all()
    assert (targets[:, 2:] >= 0).all() and (targets[:, 2:] <= 96).all()
    assert len(batch["paths"]) == len(batch["orig_shapes"]) == len(batch["ratio_pad"]) == 5
    for i, (path, shape, rp) in enumerate(zip(batch["paths"], batch["orig_shapes"],
                                              batch["ratio_pad"], strict=True)):
        k = ds.index.paths.index(path)
        assert shape == tuple(ds.index.shapes[k]) and all(isinstance(v, int) for v in shape)
        rows = targets[targets[:, 0] == i]
        expected = torch.from_numpy(ds.index.labels[k])
        assert torch.equal(rows[:, 1], expected[:, 0])
        torch.testing.assert_close(_back_to_original(rows, rp), expected[:, 1:], atol=0.05,
                                   rtol=0)


def test_images_are_rgb(tmp_path):
    red = np.zeros((32, 32, 3), np.uint8)
    red[..., 2] = 255  # BGR red
    yaml = write_yolo_dataset(tmp_path / "red", {"r.png": (red, "0 0.5 0.5 0.5 0.5\n")})
    batch = collate([DetectionDataset(yaml, "train", imgsz=32)[0]])
    assert batch["images"][0, 0].min() == 1.0 and batch["images"][0, 1:].max() == 0.0


def test_rect_batches_group_aspect_ratios(shapes_yaml):
    ds = DetectionDataset(shapes_yaml, "val", imgsz=96, rect=True, stride=32)
    loader = build_dataloader(ds, 4, workers=0)
    seen = []
    last_aspect = 0.0
    for batch in loader:
        b, _, h, w = batch["images"].shape
        assert h % 32 == 0 and w % 32 == 0 and max(h, w) == 96
        aspects = [s[0] / s[1] for s in batch["orig_shapes"]]
        assert aspects == sorted(aspects) and aspects[0] >= last_aspect
        last_aspect = aspects[-1]
        for i, rp in enumerate(batch["ratio_pad"]):
            k = ds.index.paths.index(batch["paths"][i])
            rows = batch["targets"][batch["targets"][:, 0] == i]
            torch.testing.assert_close(_back_to_original(rows, rp),
                                       torch.from_numpy(ds.index.labels[k][:, 1:]),
                                       atol=0.05, rtol=0)
        seen += batch["paths"]
    assert sorted(seen) == sorted(ds.index.paths)
    with pytest.raises(ValueError):
        build_dataloader(ds, 4, workers=0, shuffle=True)


def test_collate_pads_right_and_bottom():
    items = [{"image": torch.full((3, 32, 64), 255, dtype=torch.uint8),
              "boxes": torch.tensor([[1.0, 2, 3, 4]]), "classes": torch.tensor([2]),
              "path": "a", "orig_shape": (32, 64), "ratio_pad": ((1, 1), (0, 0)), "index": 0},
             {"image": torch.zeros((3, 64, 32), dtype=torch.uint8),
              "boxes": torch.zeros((0, 4)), "classes": torch.zeros(0, dtype=torch.int64),
              "path": "b", "orig_shape": (64, 32), "ratio_pad": ((1, 1), (0, 0)), "index": 1}]
    batch = collate(items)
    images = batch["images"]
    assert images.shape == (2, 3, 64, 64)
    grey = torch.tensor(114 / 255)
    assert (images[0, :, :32] == 1).all() and torch.allclose(images[0, :, 32:], grey)
    assert (images[1, :, :, :32] == 0).all() and torch.allclose(images[1, :, :, 32:], grey)
    assert batch["targets"].tolist() == [[0, 2, 1, 2, 3, 4]]
    assert collate(items[1:])["targets"].shape == (0, 6)


def _train_set(shapes_yaml, **kw):
    return DetectionDataset(shapes_yaml, "train", imgsz=96, augment=True, **kw)


def test_same_seed_same_batches_and_seed_epoch_change_them(shapes_yaml):
    ds = _train_set(shapes_yaml)
    a = _batches(build_dataloader(ds, 4, workers=2, seed=3), 3)
    b = _batches(build_dataloader(ds, 4, workers=2, seed=3), 3)
    assert all(_same(x, y) for x, y in zip(a, b, strict=True))
    c = _batches(build_dataloader(ds, 4, workers=2, seed=4), 1)
    assert not _same(a[0], c[0])
    loader = build_dataloader(ds, 4, workers=2, seed=3)
    loader.set_epoch(1)
    e1 = _batches(loader, 1)[0]
    assert not _same(a[0], e1)
    # without set_epoch, the second pass is epoch 1
    counting = build_dataloader(ds, 4, workers=2, seed=3)
    assert _same(_batches(counting)[0], a[0]) and _same(_batches(counting)[0], e1)


def test_main_process_is_worker_zero(shapes_yaml):
    ds = _train_set(shapes_yaml)
    a = _batches(build_dataloader(ds, 4, workers=0, seed=1), 2)
    b = _batches(build_dataloader(ds, 4, workers=1, seed=1), 2)
    assert all(_same(x, y) for x, y in zip(a, b, strict=True))


def test_workers_draw_different_augmentations(tmp_path):
    image = draw_rects((64, 64), [(10, 10, 40, 30)])
    items = {f"{i}.png": (image, "0 0.39 0.31 0.47 0.31\n") for i in range(8)}
    yaml = write_yolo_dataset(tmp_path / "same", items)
    ds = DetectionDataset(yaml, "train", imgsz=64, augment=True)
    loader = build_dataloader(ds, 1, workers=2, seed=0, shuffle=False)
    batches = _batches(loader, 4)  # batches 0, 2 from worker 0; 1, 3 from worker 1
    assert not torch.equal(batches[0]["images"], batches[1]["images"])
    assert not torch.equal(batches[2]["images"], batches[3]["images"])


def test_mosaic_switch_reaches_persistent_workers(tmp_path):
    """Every image holds one box covering it all: Mosaic gives several, no Mosaic one."""
    rng = np.random.default_rng(0)
    items = {f"{i}.jpg": ((rng.random((48, 64, 3)) * 255).astype(np.uint8), "0 0.5 0.5 1 1\n")
             for i in range(16)}
    yaml = write_yolo_dataset(tmp_path / "full", items)
    hyp = AugmentConfig(translate=0.0, scale=0.0)
    ds = DetectionDataset(yaml, "train", imgsz=64, augment=True, hyp=hyp)
    loader = build_dataloader(ds, 4, workers=2, seed=0, persistent_workers=True)

    def boxes_per_image():
        counts = []
        for batch in loader:
            counts += torch.bincount(batch["targets"][:, 0].long(), minlength=4).tolist()
        return np.array(counts)

    with_mosaic = boxes_per_image()
    workers = [w.pid for w in loader._iterator._workers]
    assert with_mosaic.mean() > 2 and with_mosaic.max() >= 3
    ds.mosaic = False  # in the main process only, workers already running
    without = boxes_per_image()
    assert [w.pid for w in loader._iterator._workers] == workers  # same processes
    assert (without == 1).all()
    ds.mosaic = True
    assert boxes_per_image().mean() > 2


def test_ram_cache_gives_the_same_items(shapes_yaml):
    plain = DetectionDataset(shapes_yaml, "val", imgsz=96)
    cached = DetectionDataset(shapes_yaml, "val", imgsz=96, cache_images=True)
    a = _batches(build_dataloader(plain, 4, workers=0))
    b = _batches(build_dataloader(cached, 4, workers=0))
    assert len(a) == 3 and all(_same(x, y) for x, y in zip(a, b, strict=True))


def test_loader_defaults(shapes_yaml):
    train = _train_set(shapes_yaml)
    loader = build_dataloader(train, 5, workers=0)
    assert loader.batch_sampler.shuffle and len(loader) == 5  # 24 images, last batch of 4
    order = [p for b in loader for p in b["paths"]]
    assert sorted(order) == sorted(train.index.paths) and order != train.index.paths
    val = DetectionDataset(shapes_yaml, "val", imgsz=96)
    assert not build_dataloader(val, 5, workers=0).batch_sampler.shuffle
    assert len(build_dataloader(train, 5, workers=0, drop_last=True)) == 4


def test_albumentations_in_the_dataset(shapes_yaml):
    A = pytest.importorskip("albumentations")
    ds = _train_set(shapes_yaml, albumentations=[A.ToGray(p=1.0)])
    item = ds[0]
    image = item["image"].float()
    assert torch.allclose(image[0], image[1], atol=2) and torch.allclose(image[1], image[2], atol=2)


def _components(image, k):
    """Pixel-edge boxes [M, 4] of the connected regions of colour k."""
    mask = (np.abs(image.astype(np.int16) - np.array(COLOURS[k])).max(-1) < 100).astype(np.uint8)
    n, _, stats, _ = cv2.connectedComponentsWithStats(mask, connectivity=8)
    x, y, w, h = stats[1:, 0], stats[1:, 1], stats[1:, 2], stats[1:, 3]
    return np.stack([x, y, x + w, y + h], 1).astype(np.float32)


def test_full_training_pipeline_keeps_boxes_on_pixels(tmp_path):
    """Mosaic + affine + flips through the Dataset: every box is the extent of one visible
    piece of its class's colour, and every piece without a box is a sliver."""
    items = {}
    for k in range(4):
        x1, y1 = 6 + 5 * k, 4 + 3 * k
        rect = (x1, y1, x1 + 20 + 4 * k, y1 + 14 + 3 * k)
        image = np.zeros((48, 64, 3), np.uint8)
        image[rect[1]:rect[3], rect[0]:rect[2]] = COLOURS[k]
        cx, cy = (rect[0] + rect[2]) / 128, (rect[1] + rect[3]) / 96
        w, h = (rect[2] - rect[0]) / 64, (rect[3] - rect[1]) / 48
        items[f"{k}.png"] = (image, f"{k} {cx} {cy} {w} {h}\n")
    yaml = write_yolo_dataset(tmp_path / "colours", items, names=("a", "b", "c", "d"))
    hyp = AugmentConfig(hsv_h=0, hsv_s=0, hsv_v=0, flipud=0.5)
    ds = DetectionDataset(yaml, "train", imgsz=64, augment=True, hyp=hyp)
    checked = 0
    for epoch in range(6):
        ds.set_epoch(epoch)
        for i in range(len(ds)):
            item = ds[i]
            image = item["image"].numpy().transpose(1, 2, 0)[..., ::-1]
            for k in range(4):
                mine = item["boxes"][item["classes"] == k].numpy()
                parts = _components(image, k)
                centres = (mine[:, :2] + mine[:, 2:]) / 2
                for part in parts:
                    inside = ((centres >= part[:2]) & (centres <= part[2:])).all(1)
                    if not inside.any():  # dropped by the size / area rules: a sliver
                        w, h = part[2:] - part[:2]
                        assert min(w, h) <= 3 or w * h < 0.15 * 32 * 23, (part, mine)
                        continue
                    hull = np.r_[mine[inside, :2].min(0), mine[inside, 2:].max(0)]
                    np.testing.assert_allclose(hull, part, atol=1.5)
                    checked += int(inside.sum())
                assert sum(((centres >= p[:2]) & (centres <= p[2:])).all(1).sum()
                           for p in parts) >= len(mine)  # no box without pixels
    assert checked > 40


def test_uint8_batches_convert_to_the_same_float_batch(shapes_yaml):
    ds = DetectionDataset(shapes_yaml, "val", imgsz=96, rect=True)
    ref = _batches(build_dataloader(ds, 4, workers=0))
    fast = _batches(build_dataloader(ds, 4, workers=2, uint8_images=True))
    for a, b in zip(ref, fast, strict=True):
        assert "images" not in b and b["images_uint8"].dtype == torch.uint8
        c = to_device(b, "cpu")
        assert "images_uint8" not in c and c["images"].dtype == torch.float32
        torch.testing.assert_close(c["images"], a["images"], atol=1e-6, rtol=0)
        assert torch.equal(c["targets"], a["targets"]) and c["paths"] == a["paths"]
        assert c["ratio_pad"] == a["ratio_pad"]
    assert to_device(ref[0], "cpu")["images"] is not None


def test_mosaic_switch_and_epochs_reach_spawned_workers(tmp_path):
    """The shared state also travels to workers started by spawn (the default elsewhere)."""
    items = {f"{i}.png": (np.full((32, 32, 3), 40 * i, np.uint8), "0 0.5 0.5 1 1\n")
             for i in range(4)}
    yaml = write_yolo_dataset(tmp_path / "spawn", items)
    hyp = AugmentConfig(translate=0.0, scale=0.0)
    ds = DetectionDataset(yaml, "train", imgsz=32, augment=True, hyp=hyp)
    loader = build_dataloader(ds, 4, workers=1, seed=0, multiprocessing_context="spawn")
    first = _batches(loader)[0]
    ds.mosaic = False
    second = _batches(loader)[0]
    assert len(first["targets"]) > 4 and len(second["targets"]) == 4


def test_a_copied_dataset_has_its_own_switch(shapes_yaml):
    import copy

    ds = _train_set(shapes_yaml)
    twin = copy.deepcopy(ds)
    twin.mosaic = False
    twin.set_epoch(7)
    assert ds.mosaic and ds.epoch == 0 and not twin.mosaic and twin.epoch == 7


def test_mixup_blends_two_views(tmp_path):
    items = {f"{i}.png": (np.full((32, 32, 3), 30 * i, np.uint8), "0 0.5 0.5 1 1\n")
             for i in range(6)}
    yaml = write_yolo_dataset(tmp_path / "mix", items)
    hyp = AugmentConfig(mosaic=0.0, mixup=1.0, translate=0.0, scale=0.0, hsv_h=0, hsv_s=0,
                        hsv_v=0)
    ds = DetectionDataset(yaml, "train", imgsz=32, augment=True, hyp=hyp)
    for i in range(6):
        item = ds[i]
        assert len(item["boxes"]) == 2  # one full-image box from each view
        assert item["image"].float().std() < 1  # two flat images blend into a flat one


def test_rect_batches_are_split_across_ranks(shapes_yaml):
    from yolokit.data import AspectRatioBatchSampler

    shapes = DetectionDataset(shapes_yaml, "val", imgsz=96).shapes
    full = list(AspectRatioBatchSampler(shapes, 3))
    parts = [list(AspectRatioBatchSampler(shapes, 3, rank=r, world_size=2)) for r in (0, 1)]
    assert parts[0] + parts[1] != full and sorted(parts[0] + parts[1]) == sorted(full)
    assert sorted(i for b in full for i in b) == list(range(len(shapes)))


def test_distributed_uses_the_process_group(shapes_yaml, tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        ds = _train_set(shapes_yaml)
        loader = build_dataloader(ds, 4, workers=0, seed=2)
        assert loader.batch_sampler.world_size == 1 and loader.batch_sampler.rank == 0
        assert loader.batch_sampler.seed == 2 and len(_batches(loader, 1)[0]["paths"]) == 4
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,accumulate,size,batch", [(2, 2, 21, 2), (3, 2, 25, 2), (3, 1, 10, 4), (4, 3, 7, 1)])
def test_sharded_batches_equal_one_process_accumulating_them(world, accumulate, size, batch):
    """Ranks' micro-batches, step by step and in rank order, are one process's micro-batches."""
    from yolokit.data import ShardedBatchSampler

    single = ShardedBatchSampler(size, batch, accumulate=world * accumulate, seed=5)
    shards = [ShardedBatchSampler(size, batch, rank=r, world_size=world, accumulate=accumulate, seed=5)
              for r in range(world)]
    for epoch in (0, 1):
        for s in [single, *shards]:
            s.set_epoch(epoch)
        one = list(single)
        mine = [list(s) for s in shards]
        assert [len(m) for m in mine] == [len(s) for s in shards]
        steps = -(-len(one) // (world * accumulate))
        rebuilt = []
        for step in range(steps):
            for r in range(world):
                rebuilt += mine[r][step * accumulate:(step + 1) * accumulate]
        assert rebuilt == one
        flat = sorted(i for b in one for i in b)
        assert flat == list(range(size))  # every image once: nothing padded, nothing dropped
    single.set_epoch(0)
    assert list(single) != list(ShardedBatchSampler(size, batch, accumulate=world * accumulate, seed=4))


def test_sharded_remainder_goes_to_the_lowest_ranks():
    from yolokit.data import ShardedBatchSampler

    # 25 images in micro-batches of 2 -> 13 micro-batches (the last holds 1 image); 3 ranks x 2 per step
    # -> steps of 6: two full steps, then 1 micro-batch for rank 0 and none for ranks 1 and 2.
    shards = [ShardedBatchSampler(25, 2, rank=r, world_size=3, accumulate=2, shuffle=False) for r in range(3)]
    assert [len(s) for s in shards] == [5, 4, 4]
    assert list(shards[0])[-1] == [24]
    assert list(shards[1]) == [[4, 5], [6, 7], [16, 17], [18, 19]]
    assert len(ShardedBatchSampler(25, 2, rank=0, world_size=3, accumulate=2, drop_last=True)) == 4
    with pytest.raises(ValueError):
        ShardedBatchSampler(10, 2, rank=3, world_size=3)


def test_augmentation_depends_on_seed_epoch_and_index_only(shapes_yaml):
    """The same item is drawn identically by any worker or process (no Mosaic buffer)."""
    ds = _train_set(shapes_yaml, buffer_size=0)
    ds.set_seed(4)
    ds.set_epoch(2)
    a = [ds[i]["image"] for i in (3, 7)]
    other = _train_set(shapes_yaml, buffer_size=0)
    other.set_seed(4)
    other.set_epoch(2)
    b = [other[i]["image"] for i in (7, 3)]  # other order, other dataset object
    assert torch.equal(a[0], b[1]) and torch.equal(a[1], b[0])
    other.set_epoch(3)
    assert not torch.equal(other[3]["image"], a[0])
