"""Rect training: fixed aspect-ratio batches in a shuffled order, each image letterboxed to its batch's shape."""

from __future__ import annotations

import math

import numpy as np
import pytest

from yolokit.data import AugmentConfig, DetectionDataset, RectBatchSampler, ShardedBatchSampler, build_dataloader
from yolokit.data.samplers import epoch_steps

from .conftest import COLOURS, write_yolo_dataset


def _own_shape(h: int, w: int, imgsz: int, stride: int) -> tuple[int, int]:
    """Long side imgsz, the other side rounded, then padded up to a multiple of the stride."""
    r = imgsz / max(h, w)
    return math.ceil(round(h * r) / stride) * stride, math.ceil(round(w * r) / stride) * stride


def test_rect_training_batches_have_their_images_stride_aligned_aspect_shape(shapes_yaml):
    ds = DetectionDataset(shapes_yaml, "train", imgsz=128, augment=True)
    loader = build_dataloader(ds, 4, workers=0, seed=0, rect=True)
    assert isinstance(loader.batch_sampler, RectBatchSampler) and ds.rect
    shapes, seen = set(), []
    for batch in loader:
        h, w = batch["images"].shape[-2:]
        own = [_own_shape(*ds.shapes[i], 128, 32) for i in batch["indices"]]
        assert (h, w) == tuple(np.max(own, 0))           # the batch's images' widest rect shape
        assert h % 32 == 0 and w % 32 == 0 and max(h, w) == 128
        for k, i in enumerate(batch["indices"]):         # every image already has it: no collate padding
            assert tuple(ds[i]["image"].shape[1:]) == (h, w)
            rows = batch["targets"][batch["targets"][:, 0] == k]
            assert (rows[:, [2, 4]] <= w).all() and (rows[:, [3, 5]] <= h).all()
        shapes.add((h, w))
        seen += batch["indices"]
    assert sorted(seen) == list(range(len(ds)))          # every image once
    assert any(h != w for h, w in shapes) and (128, 128) in shapes    # not all square: the set has both


def test_rect_batches_stay_fixed_and_their_order_changes_with_the_epoch(shapes_yaml):
    ds = DetectionDataset(shapes_yaml, "train", imgsz=128, augment=True)
    loader = build_dataloader(ds, 4, workers=0, seed=1, rect=True)
    sampler = loader.batch_sampler
    orders = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    assert all(sorted(map(sorted, o)) == sorted(map(sorted, sampler.batches)) for o in orders)
    assert orders[0] != orders[1] != orders[2]           # the order is shuffled per epoch ...
    again = RectBatchSampler(ds.shapes, 4, seed=1)
    again.set_epoch(1)
    assert list(again) == orders[1]                      # ... from (seed, epoch) only
    fixed = RectBatchSampler(ds.shapes, 4, seed=1, shuffle=False)
    assert list(fixed) == sampler.batches                # no shuffle: the aspect order
    ratios = [ds.shapes[b, 0] / ds.shapes[b, 1] for b in sampler.batches]
    assert all(a.max() <= b.min() for a, b in zip(ratios, ratios[1:], strict=False))   # grouped by aspect


@pytest.mark.parametrize("world,accumulate,size,batch", [(1, 3, 13, 2), (2, 2, 21, 2), (3, 1, 10, 4), (2, 3, 7, 1)])
def test_rect_batches_are_shared_out_like_sharded_micro_batches(world, accumulate, size, batch):
    """The same step counts as the trainer's plan; ranks' batches of a step are one process's; resume skips steps."""
    rng = np.random.default_rng(size)
    shapes = rng.integers(40, 160, (size, 2))
    single = RectBatchSampler(shapes, batch, accumulate=world * accumulate, seed=4)
    single.set_epoch(2)
    steps = list(single)
    group = world * accumulate
    for whole_steps in (False, True):
        shards = [RectBatchSampler(shapes, batch, rank=r, world_size=world, accumulate=accumulate, seed=4,
                                   whole_steps=whole_steps) for r in range(world)]
        plain = ShardedBatchSampler(size, batch, world_size=world, accumulate=accumulate, whole_steps=whole_steps)
        count = epoch_steps(size, batch, world_size=world, accumulate=accumulate, whole_steps=whole_steps)
        assert shards[0].steps_per_epoch == plain.steps_per_epoch == count
        for s in shards:
            s.set_epoch(2)
        mine = [list(s) for s in shards]
        plains = [ShardedBatchSampler(size, batch, rank=r, world_size=world, accumulate=accumulate,
                                      whole_steps=whole_steps) for r in range(world)]
        assert [len(s) for s in shards] == [len(m) for m in mine] == [len(p) for p in plains]
        rebuilt = []                                     # step by step, in rank order
        for k in range(count):
            for m in mine:
                rebuilt += m[k * accumulate:(k + 1) * accumulate]
        assert rebuilt == steps[:len(rebuilt)]
        assert len(rebuilt) == (len(steps) // group * group if whole_steps else len(steps))
        for start in range(count + 1):                   # resume after `start` steps
            for r, s in enumerate(shards):
                s.set_epoch(2, start_step=start)
                assert list(s) == mine[r][start * accumulate:] and len(s) == len(mine[r][start * accumulate:])


def test_drop_last_leaves_the_short_batch_out():
    shapes = np.array([[64, 64]] * 7)
    sampler = RectBatchSampler(shapes, 3, drop_last=True)
    assert [len(b) for b in sampler] == [3, 3] and sampler.steps_per_epoch == 2


def test_rect_training_boxes_follow_the_painted_rectangles(tmp_path):
    """Images of 4 aspects, each with coloured rectangles, through rect batches with flips and a scale +
    translate affine: every box is the extent of its colour's visible pixels in the batch image."""
    items, sizes = {}, [(96, 128), (128, 96), (64, 128), (128, 128), (80, 128), (128, 64)]
    for n, (h, w) in enumerate(sizes):
        image, lines = np.zeros((h, w, 3), np.uint8), []
        for k in range(2):                               # inside the narrowest side (64)
            x1, y1 = 4 + 26 * k + n, 6 + 24 * k + n
            x2, y2 = x1 + 20 + 2 * k, y1 + 16 + 4 * k
            image[y1:y2, x1:x2] = COLOURS[k]
            lines.append(f"{k} {(x1 + x2) / 2 / w} {(y1 + y2) / 2 / h} {(x2 - x1) / w} {(y2 - y1) / h}\n")
        items[f"{n}.png"] = (image, "".join(lines))
    yaml = write_yolo_dataset(tmp_path / "colours", items)
    hyp = AugmentConfig(hsv_h=0, hsv_s=0, hsv_v=0, fliplr=0.5, flipud=0.5, scale=0.2, translate=0.1, mixup=1.0)
    ds = DetectionDataset(yaml, "train", imgsz=128, augment=True, hyp=hyp)
    loader = build_dataloader(ds, 2, workers=0, seed=0, rect=True)
    checked, shapes = 0, set()
    for epoch in range(4):
        loader.set_epoch(epoch)
        for batch in loader:
            images = batch["images"]
            shapes.add(tuple(images.shape[-2:]))
            for b in range(len(images)):
                bgr = (images[b].numpy().transpose(1, 2, 0)[..., ::-1] * 255).round().astype(np.int16)
                rows = batch["targets"][batch["targets"][:, 0] == b]
                for k in range(2):
                    mask = np.abs(bgr - np.array(COLOURS[k])).max(-1) < 100
                    box = rows[rows[:, 1] == k, 2:].numpy()
                    assert len(box) <= 1                 # one rectangle per colour: no MixUp partner
                    if not mask.any():                   # moved out of the picture: no box either
                        assert len(box) == 0
                        continue
                    ys, xs = np.nonzero(mask)
                    extent = np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], np.float32)
                    if len(box) == 0:                    # dropped by the area rule: only a sliver is left
                        assert mask.sum() < 0.12 * 22 * 20 * 1.2 ** 2
                        continue
                    np.testing.assert_allclose(box[0], extent, atol=1.5)
                    checked += 1
    assert checked > 30
    assert {(96, 128), (128, 96), (128, 128)} <= shapes  # rect shapes (MixUp is left out: one picture each)


def test_loader_workers_letterbox_to_the_batch_shapes_too(shapes_yaml):
    def epoch(workers):
        ds = DetectionDataset(shapes_yaml, "train", imgsz=128, augment=True)
        loader = build_dataloader(ds, 4, workers=workers, seed=2, rect=True)
        try:
            return [(b["indices"], b["images"], b["targets"]) for b in loader]
        finally:
            loader.close()

    for (ia, a, ta), (ib, b, tb) in zip(epoch(0), epoch(1), strict=True):
        assert ia == ib and a.shape == b.shape and (a == b).all() and (ta == tb).all()


def test_rect_training_keeps_no_mosaic_buffer(shapes_yaml):
    from yolokit.data import DetectionDataset, build_dataloader

    dataset = DetectionDataset(shapes_yaml, "train", imgsz=96, augment=True, buffer_size=16)
    assert dataset.buffer_size == 16
    loader = build_dataloader(dataset, 4, workers=0, seed=0, rect=True)
    for batch in loader:
        assert batch["images"].shape[0] <= 4
    assert dataset.buffer_size == 0 and dataset._buffer == {}     # decoded images would never be reused
