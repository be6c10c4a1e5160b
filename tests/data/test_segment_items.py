"""A segmentation set's items and batches: each object's mask follows its image through every step.

The shapes set labelled by outlines (``make_shapes(segments=True)``) is drawn with OpenCV's polygon fill
from the very points it writes, so an item's mask can be checked against the pixels: without
augmentation it is the fill itself, shifted by the letterbox; through Mosaic, a rotating, shearing,
perspective warp, the flips and the HSV step, the pixels under a mask (its edge left out) are one
object's colour, which a mask left unflipped or unwarped would not cover.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from yolokit.data import DetectionDataset, build_dataloader, collate, make_shapes, to_device
from yolokit.data.augment.polygons import resample_polygon
from yolokit.data.augment.transforms import AugmentConfig
from yolokit.data.sources.coco import join_parts
from yolokit.data.sources.readers import DatasetError


@pytest.fixture(scope="module")
def seg(tmp_path_factory):
    """One object an image (Mosaic puts four side by side, none hidden by another)."""
    return make_shapes(tmp_path_factory.mktemp("seg") / "set", n_train=12, n_val=6, imgsz=96, max_objects=1,
                       background_fraction=0.0, segments=True)


@pytest.fixture(scope="module")
def seg_many(tmp_path_factory):
    return make_shapes(tmp_path_factory.mktemp("seg-many") / "set", n_train=10, n_val=4, imgsz=96, segments=True)


def test_the_outlines_label_the_same_images_as_the_boxes(tmp_path, seg_many):
    boxes = make_shapes(tmp_path / "det", n_train=10, n_val=4, imgsz=96)
    a = DetectionDataset(boxes, "train", imgsz=96)
    b = DetectionDataset(seg_many, "train", imgsz=96)
    assert seg_many.parent.name == "set" and a.index.segments is None and b.index.segments is not None
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert torch.equal(x["image"], y["image"]) and torch.equal(x["classes"], y["classes"])
        # the box of the pixels the fill paints (whole pixels, the last one past the outline's last point)
        # against the outline's (its points read back from 6 decimals)
        assert (x["boxes"] - y["boxes"]).abs().max() <= 2 + 1e-3


@pytest.mark.parametrize("overlap", [True, False])
def test_without_augmentation_a_mask_is_the_outline_filled_where_the_letterbox_put_it(seg_many, overlap):
    ds = DetectionDataset(seg_many, "val", imgsz=96, segments=True, mask_ratio=1, overlap_mask=overlap)
    for i in range(len(ds)):
        item = ds[i]
        pad = np.array(item["ratio_pad"][1])
        assert item["ratio_pad"][0] == (1.0, 1.0)                           # 96 px already: no resize
        outlines = ds.index.segments.image(i)
        expected = []
        for poly in outlines:          # resampled to 1000 points as every polygon is, then filled
            m = np.zeros((96, 96), np.uint8)
            cv2.fillPoly(m, [(resample_polygon(poly) + pad.astype(np.float32)).astype(np.int32)], 1)
            expected.append(m)
        got = item["masks"].numpy()
        if overlap:   # larger first: a row's value covers its own fill, except where a smaller row lies on it
            assert got.shape == (96, 96) and got.max() == len(outlines)
            areas = [int(e.sum()) for e in expected]      # larger first (an object of no pixel before all)
            order = sorted(range(len(areas)), key=lambda k: (areas[k] > 0, -areas[k]))
            for value, k in enumerate(order, 1):
                assert ((got == value) <= expected[k]).all()
                assert torch.allclose(item["boxes"][value - 1],
                                      ds[i]["boxes"][value - 1])          # the same order every time
        else:
            assert got.shape == (len(outlines), 96, 96)
            for k in range(len(outlines)):
                assert np.array_equal(got[k], expected[k])
        assert item["mask_rows"].all() and len(item["mask_rows"]) == len(item["classes"])


def _object_like(image: torch.Tensor, mask: np.ndarray) -> bool:
    """Whether ``mask`` covers one shape: the pixels well inside it are one colour (largest per-channel standard
    deviation under 12), unlike the band just outside it (mean colours 40 apart, summed over the channels)."""
    mask = mask.astype(np.uint8)
    inner = cv2.erode(mask, np.ones((5, 5), np.uint8)).astype(bool)
    near = cv2.dilate(mask, np.ones((3, 3), np.uint8)).astype(bool)
    band = cv2.dilate(mask, np.ones((5, 5), np.uint8)).astype(bool) & ~near            # 1-2 px outside
    pixels = image.permute(1, 2, 0).numpy().astype(np.float32)
    if not band.any():
        return False
    inside, outside = pixels[inner], pixels[band]
    return bool(inside.std(0).max() < 12 and np.abs(inside.mean(0) - outside.mean(0)).sum() > 40)


def test_through_mosaic_warps_and_flips_each_mask_covers_one_colour(seg):
    hyp = AugmentConfig(mosaic=1.0, degrees=20.0, shear=5.0, perspective=0.0005, translate=0.1, scale=0.3,
                        fliplr=0.5, flipud=0.5, mixup=0.0)
    ds = DetectionDataset(seg, "train", imgsz=96, augment=True, hyp=hyp, segments=True, mask_ratio=1,
                          overlap_mask=False, buffer_size=0)
    checked = 0
    for epoch in range(3):
        ds.set_epoch(epoch)
        for i in range(len(ds)):
            item = ds[i]
            masks, boxes = item["masks"].numpy(), item["boxes"]
            assert len(masks) == len(boxes) == len(item["mask_rows"]) and item["mask_rows"].all()
            for m, box in zip(masks, boxes, strict=True):
                ys, xs = np.nonzero(m)
                if len(xs) == 0:
                    continue
                x1, y1, x2, y2 = box.tolist()                     # the visible outline's box holds its fill
                assert x1 - 1 <= xs.min() and xs.max() <= x2 + 1 and y1 - 1 <= ys.min() and ys.max() <= y2 + 1
                if cv2.erode(m, np.ones((5, 5), np.uint8)).sum() >= 20:
                    assert _object_like(item["image"], m), (epoch, i)
                    checked += 1
    assert checked >= 30


def test_a_mask_left_unflipped_would_be_seen(seg):
    """The colour check above is a real one: the same masks mirrored leave the objects."""
    hyp = AugmentConfig(mosaic=0.0, degrees=0.0, shear=0.0, translate=0.0, scale=0.0, fliplr=0.0, flipud=0.0,
                        hsv_h=0.0, hsv_s=0.0, hsv_v=0.0)
    ds = DetectionDataset(seg, "train", imgsz=96, augment=True, hyp=hyp, segments=True, mask_ratio=1,
                          overlap_mask=False)
    seen = []
    for i in range(len(ds)):
        item = ds[i]
        for m in item["masks"].numpy():
            mirrored = m[:, ::-1].copy()
            if cv2.erode(m, np.ones((5, 5), np.uint8)).sum() >= 20 and (m & mirrored).sum() < 0.3 * m.sum():
                assert _object_like(item["image"], m)
                seen.append(_object_like(item["image"], mirrored))
    assert len(seen) >= 3 and not any(seen), seen


def test_mixup_keeps_both_images_rows_and_masks(seg):
    hyp = AugmentConfig(mosaic=0.0, mixup=1.0)
    ds = DetectionDataset(seg, "train", imgsz=96, augment=True, hyp=hyp, segments=True, overlap_mask=False)
    counts = [len(ds[i]["classes"]) for i in range(len(ds))]
    assert max(counts) == 2 and all(len(ds[i]["masks"]) == c for i, c in enumerate(counts))


@pytest.mark.parametrize("overlap", [True, False])
def test_a_batch_pads_the_masks_as_the_images_and_keeps_the_rows_order(seg_many, overlap):
    """Rect shapes of two sizes: the masks padded with background; each row's mask (or value) within its box."""
    ds = DetectionDataset(seg_many, "val", imgsz=96, rect=True, stride=8, segments=True, overlap_mask=overlap)
    items = [ds[i] for i in range(len(ds))]
    assert len({tuple(it["image"].shape) for it in items}) > 1        # rect: images of different shapes
    batch = collate(items)
    b, _, h, w = batch["images"].shape
    masks, targets = batch["masks"], batch["targets"]
    assert batch["mask_rows"].shape == (len(targets),) and batch["mask_rows"].all()
    assert masks.shape == ((b,) if overlap else (len(targets),)) + (h // 4, w // 4)
    first = {int(i): k for k, i in reversed(list(enumerate(targets[:, 0].tolist())))}
    for r, (i, _, x1, y1, x2, y2) in enumerate(targets.tolist()):
        m = masks[int(i)] == r - first[int(i)] + 1 if overlap else masks[r].bool()
        ys, xs = torch.nonzero(m, as_tuple=True)
        if len(xs):
            assert x1 / 4 - 1 <= xs.min() <= xs.max() <= x2 / 4 + 1
            assert y1 / 4 - 1 <= ys.min() <= ys.max() <= y2 / 4 + 1


def test_the_loader_brings_masks_to_the_device_side(seg_many):
    ds = DetectionDataset(seg_many, "train", imgsz=96, augment=True, segments=True)
    batches = list(build_dataloader(ds, 4, workers=2, seed=0, uint8_images=True))
    assert [len(b["masks"]) for b in batches] == [4, 4, 2]            # 10 images: the last batch short
    for b in batches:
        moved = to_device(b, "cpu")
        assert torch.equal(moved["masks"], b["masks"]) and torch.equal(moved["mask_rows"], b["mask_rows"])
        assert b["masks"].dtype == torch.uint8 and b["masks"].shape[1:] == (24, 24)
        assert len(b["mask_rows"]) == len(b["targets"])
        for i in range(len(b["masks"])):
            rows = int((b["targets"][:, 0] == i).sum())
            assert int(b["masks"][i].max()) <= rows


def test_a_mixed_set_keeps_its_box_rows_without_masks(tmp_path):
    root = tmp_path / "mixed"
    (root / "images" / "train").mkdir(parents=True)
    (root / "labels" / "train").mkdir(parents=True)
    cv2.imwrite(str(root / "images" / "train" / "a.jpg"), np.full((64, 64, 3), 90, np.uint8))
    (root / "labels" / "train" / "a.txt").write_text("0 0.1 0.1 0.5 0.1 0.5 0.5 0.1 0.5\n1 0.75 0.75 0.3 0.3\n")
    (root / "data.yaml").write_text(f"path: {root}\ntrain: images/train\nval: images/train\nnames: [a, b]\n")
    ds = DetectionDataset(root / "data.yaml", "train", imgsz=64, segments=True, overlap_mask=False, mask_ratio=1)
    item = ds[0]
    by_class = {int(c): k for k, c in enumerate(item["classes"])}
    assert item["mask_rows"][by_class[0]] and not item["mask_rows"][by_class[1]]
    assert item["masks"][by_class[1]].sum() == 0                       # a box row: no pixel, no claim
    assert abs(int(item["masks"][by_class[0]].sum()) - 26 * 26) < 60   # the square 0.1-0.5 of 64 px
    assert torch.allclose(item["boxes"][by_class[1]], torch.tensor([38.4, 38.4, 57.6, 57.6]))


def test_what_cannot_carry_polygons_is_refused_in_one_line(tmp_path, seg_many):
    boxes = make_shapes(tmp_path / "det", n_train=4, n_val=2, imgsz=64)
    with pytest.raises(DatasetError, match=r"data\.yaml \(train\): no label row has a polygon"):
        DetectionDataset(boxes, "train", segments=True)
    with pytest.raises(ValueError, match="albumentations cannot be used with segments yet"):
        DetectionDataset(seg_many, "train", segments=True, augment=True, albumentations=[])
    with pytest.raises(ValueError, match="mask_ratio must be a positive integer"):
        DetectionDataset(seg_many, "train", segments=True, mask_ratio=0)
    ds = DetectionDataset(seg_many, "train", segments=True, augment=True, hyp=AugmentConfig(copy_paste=0.5))
    with pytest.raises(ValueError, match=r"augment_on='device' cannot copy-paste \(copy_paste 0\.5"):
        build_dataloader(ds, 2, workers=0, augment_on="device")


DEVICE_CASES = {"mosaic": {}, "letterbox": dict(mosaic=0.0),
                "mixup-warps-flips": dict(mixup=1.0, degrees=10.0, shear=2.0, perspective=0.001, flipud=0.5)}


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("case", list(DEVICE_CASES))
def test_the_device_path_makes_the_workers_masks_bit_for_bit(seg_many, case, overlap):
    """augment_on="device": the same draws, so the same boxes, classes and masks (drawn from the same polygons
    in the loader, as the boxes are), and the images made on the device within a grey level of the workers'."""
    from yolokit.data.augment.device_augment import augment_batch
    batches = []
    for on in ("workers", "device"):
        ds = DetectionDataset(seg_many, "train", imgsz=64, augment=True, hyp=AugmentConfig(**DEVICE_CASES[case]),
                              segments=True, overlap_mask=overlap)
        batches.append(next(iter(build_dataloader(ds, 8, workers=0, seed=1, uint8_images=True, augment_on=on))))
    a, b = batches
    assert "aug_tiles" in b and "images_uint8" not in b
    assert len(a["targets"]) > 8 and torch.equal(a["targets"], b["targets"])
    assert a["masks"].shape[-2:] == (16, 16) and a["masks"].shape[0] == (8 if overlap else len(a["targets"]))
    assert torch.equal(a["masks"], b["masks"]) and torch.equal(a["mask_rows"], b["mask_rows"])
    assert a["masks"].amax() > 0
    images = augment_batch(b, "cpu")
    assert (images.int() - a["images_uint8"].int()).abs().float().mean((1, 2, 3)).max() <= 1.0
    moved = to_device(b, "cpu")
    assert torch.equal(moved["masks"], a["masks"]) and moved["images"].shape == a["images_uint8"].shape


def test_worker_processes_ship_device_recipes_with_their_masks(seg_many):
    ds = DetectionDataset(seg_many, "train", imgsz=64, augment=True, segments=True)
    one, two = (next(iter(build_dataloader(ds, 4, workers=w, seed=2, uint8_images=True, augment_on="device")))
                for w in (0, 2))
    assert torch.equal(one["masks"], two["masks"]) and torch.equal(one["targets"], two["targets"])
    assert torch.equal(one["aug_jpeg"], two["aug_jpeg"])


def _filled(polygons, shape=(64, 80)):
    m = np.zeros(shape, np.uint8)
    for p in polygons:
        cv2.fillPoly(m, [np.asarray(p, np.float64).astype(np.int32)], 1)
    return m


def test_an_objects_parts_are_joined_into_one_outline_that_fills_as_they_do():
    parts = [np.array([[5, 5], [20, 5], [20, 20], [5, 20]], np.float64),
             np.array([[40, 30], [60, 30], [50, 50]], np.float64),
             np.array([[10, 40], [25, 40], [25, 55], [10, 55]], np.float64)]
    outline = join_parts(parts)
    assert {tuple(p) for p in outline} == {tuple(p) for part in parts for p in part}   # every point, no other
    assert len(outline) == sum(len(p) + 1 for p in parts) + 1                      # each part closed, bridges
    union, joined = _filled(parts), _filled([outline])
    assert (union <= joined).all()                          # the parts' pixels, and along the bridges only:
    assert (joined.sum() - union.sum()) < 2 * 60            # two lines of a pixel's width at most
    assert np.array_equal(join_parts(parts[:1]), parts[0])


def test_a_coco_json_gives_each_objects_outline(tmp_path):
    import json

    mask_utils = pytest.importorskip("pycocotools.mask")
    cv2.imwrite(str(tmp_path / "a.jpg"), np.full((64, 80, 3), 90, np.uint8))
    square, triangle = [5, 5, 20, 5, 20, 20, 5, 20], [40, 30, 60, 30, 50, 50]
    block = np.zeros((64, 80), np.uint8)
    block[40:50, 60:70] = 1
    rle = mask_utils.encode(np.asfortranarray(block))
    rle["counts"] = rle["counts"].decode()
    annotations = [
        {"id": 1, "image_id": 7, "category_id": 3, "bbox": [5, 5, 15, 15], "iscrowd": 0, "segmentation": [square]},
        {"id": 2, "image_id": 7, "category_id": 5, "bbox": [5, 5, 55, 45], "iscrowd": 0,
         "segmentation": [square, triangle]},                                      # one object in two parts
        {"id": 3, "image_id": 7, "category_id": 3, "bbox": [60, 40, 10, 10], "iscrowd": 0,
         "segmentation": rle},                                                     # RLE: its outline
        {"id": 4, "image_id": 7, "category_id": 5, "bbox": [0, 0, 30, 30], "iscrowd": 1,
         "segmentation": {"counts": [0, 10], "size": [64, 80]}},                    # crowd: left out
        {"id": 5, "image_id": 7, "category_id": 5, "bbox": [30, 2, 8, 8], "iscrowd": 0,
         "segmentation": {"counts": [0, 10], "size": [32, 40]}},                    # another size: a box row
    ]
    (tmp_path / "instances.json").write_text(json.dumps({
        "images": [{"id": 7, "file_name": "a.jpg", "height": 64, "width": 80}], "annotations": annotations,
        "categories": [{"id": 3, "name": "x"}, {"id": 5, "name": "y"}]}))
    ds = DetectionDataset(tmp_path / "instances.json", imgsz=80, segments=True, overlap_mask=False, mask_ratio=1)
    rows = ds.index.segments.image(0)
    assert len(rows) == 4 and rows[3] is None and np.array_equal(rows[0], np.array(square, np.float32).reshape(-1, 2))
    assert rows[2].min(0).tolist() == [60, 40] and rows[2].max(0).tolist() == [69, 49]   # the RLE's outline
    (problem,) = ds.index.problems
    assert "annotation 5: RLE size 40x32 differs from the image's 80x64, kept as a box row" in problem.reason
    item = ds[0]
    assert item["mask_rows"].tolist() == [True, True, True, False] and item["classes"].tolist() == [0, 1, 0, 1]
    pad = item["ratio_pad"][1][1]                                                   # 80 x 64 into 80 x 80
    masks = item["masks"].numpy()[:, int(pad):int(pad) + 64]
    both = _filled([np.reshape(square, (-1, 2)), np.reshape(triangle, (-1, 2))])
    missed, extra = int((both & ~masks[1].astype(bool)).sum()), int((masks[1].astype(bool) & ~both.astype(bool)).sum())
    assert missed < 0.03 * both.sum() and extra < 40, (missed, extra, int(both.sum()))   # both parts, a bridge
    assert 81 <= masks[2].sum() <= 100 and masks[2][40:50, 60:70].sum() == masks[2].sum()   # the block
    assert masks[3].sum() == 0


def test_shards_keep_the_polygons_also_when_a_cut_short_write_is_finished(tmp_path, seg_many):
    pytest.importorskip("litdata")                 # yolokit[stream]
    from yolokit.data.store.shards import write_shards

    out = tmp_path / "shards"
    write_shards(seg_many, str(out), chunk_bytes="8KB", splits=["train"])
    chunks = sorted((out / "train").glob("chunk-*.bin"))
    assert len(chunks) >= 3                                             # the parts of several chunks joined
    chunks[1].write_bytes(chunks[1].read_bytes()[:100])                 # an upload that stopped
    write_shards(seg_many, str(out), chunk_bytes="8KB", splits=["train"])   # chunk 0 cut out of labels.npz
    folder = DetectionDataset(seg_many, "train", imgsz=96, segments=True)
    sharded = DetectionDataset(str(out / "train"), "train", imgsz=96, segments=True)
    a, b = folder.index.segments, sharded.index.segments
    assert [Path(p).name for p in folder.index.paths] == [str(p).rsplit("/", 1)[-1] for p in sharded.index.paths]
    assert np.array_equal(a.starts, b.starts) and np.array_equal(a.bounds, b.bounds)
    assert np.array_equal(a.points, b.points) and np.array_equal(a.boxes, b.boxes)
    for i in range(len(folder)):
        assert torch.equal(folder[i]["masks"], sharded[i]["masks"])


def test_detection_shards_have_no_polygons_and_are_refused_for_masks(tmp_path):
    pytest.importorskip("litdata")
    from yolokit.data.store.shards import write_shards

    boxes = make_shapes(tmp_path / "det", n_train=4, n_val=2, imgsz=64)
    write_shards(boxes, str(tmp_path / "shards"), splits=["val"])
    assert DetectionDataset(str(tmp_path / "shards" / "val"), "val").index.segments is None
    with pytest.raises(DatasetError, match="no label row has a polygon"):
        DetectionDataset(str(tmp_path / "shards" / "val"), "val", segments=True)


def test_copy_paste_adds_each_object_mirrored_where_it_covers_little(seg_many):
    """Copy-paste alone (no Mosaic, no warp): the pasted rows are mirrored rows, drawn from the mirrored image,
    and each covers less than 30% of every row's box that was there."""
    still = dict(mosaic=0.0, degrees=0.0, translate=0.0, scale=0.0, fliplr=0.0, hsv_h=0.0, hsv_s=0.0, hsv_v=0.0)
    plain = DetectionDataset(seg_many, "train", imgsz=96, augment=True, hyp=AugmentConfig(**still),
                             segments=True, overlap_mask=False, mask_ratio=1)
    pasted = DetectionDataset(seg_many, "train", imgsz=96, augment=True, segments=True, overlap_mask=False,
                              mask_ratio=1, hyp=AugmentConfig(**still, copy_paste=1.0))
    added = 0
    for i in range(len(plain)):
        a, b = plain[i], pasted[i]
        n = len(a["boxes"])
        keys = [tuple(box) for box in a["boxes"].tolist()]
        assert sorted(tuple(box) for box in b["boxes"][:n].tolist()) == sorted(keys) or len(b["boxes"]) > n
        old = {tuple(box): (c, m) for box, c, m in zip(a["boxes"].tolist(), a["classes"].tolist(), a["masks"],
                                                       strict=True)}
        new = [(tuple(box), c, m) for box, c, m in zip(b["boxes"].tolist(), b["classes"].tolist(), b["masks"],
                                                       strict=True) if tuple(box) not in old]
        added += len(new)
        w = a["image"].shape[2]
        for (x1, y1, x2, y2), c, m in new:          # a mirrored original: its class, its mask flipped, its pixels
            source = (w - x2, y1, w - x1, y2)
            match = min(old, key=lambda box: sum(abs(p - q) for p, q in zip(box, source, strict=True)))
            assert sum(abs(p - q) for p, q in zip(match, source, strict=True)) < 1e-3 and old[match][0] == c
            flipped = old[match][1].flip(-1).bool()      # a point on a pixel's edge fills the pixel after it
            iou = max(float((m.bool() & f).sum() / (m.bool() | f).sum()) for f in (flipped, flipped.roll(1, -1)))
            if flipped.sum() >= 100:     # a shape of a few pixels mirrored fills other pixels (truncated points)
                assert iou > 0.9, iou
            inside = cv2.erode(m.numpy(), np.ones((3, 3), np.uint8)).astype(bool)
            assert torch.equal(b["image"][:, inside], a["image"].flip(-1)[:, inside])
            for box in old:
                bx1, by1, bx2, by2 = box
                inter = max(0, min(x2, bx2) - max(x1, bx1)) * max(0, min(y2, by2) - max(y1, by1))
                assert inter < 0.3 * (bx2 - bx1) * (by2 - by1)
    assert added >= 5


def test_the_built_in_segmentation_set_is_a_source_name_everywhere(tmp_path, monkeypatch, seg_many):
    """"shapes-seg" (make_shapes(segments=True)) for a dataset and for `yolokit data shard`."""
    import yolokit.data.sources.shapes as shapes_module
    from yolokit.data.store.shards import _splits_of

    asked = []
    monkeypatch.setattr(shapes_module, "make_shapes", lambda **kw: asked.append(kw) or seg_many)
    assert _splits_of("shapes-seg", None)[1] == seg_many.parent and asked == [{"segments": True}]
    assert DetectionDataset("shapes-seg", "val", segments=True).index.segments is not None
    assert asked[-1] == {"segments": True}


@pytest.mark.parametrize("cache", ["ram", "disk"])
def test_cached_images_give_the_same_masks(tmp_path, seg_many, cache):
    kw = dict(imgsz=96, augment=True, segments=True, buffer_size=0)
    plain = DetectionDataset(seg_many, "train", **kw)
    cached = DetectionDataset(seg_many, "train", cache_images=cache, cache_dir=tmp_path / "cache", **kw)
    for i in range(len(plain)):
        a, b = plain[i], cached[i]
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["masks"], b["masks"])
        assert torch.equal(a["boxes"], b["boxes"]) and len(a["masks"]) == 96 // 4


def test_copy_paste_on_a_set_read_for_boxes_says_once_that_it_is_off(tmp_path, caplog):
    boxes = make_shapes(tmp_path / "det", n_train=4, n_val=2, imgsz=64)
    with caplog.at_level("WARNING", logger="yolokit.data"):
        ds = DetectionDataset(boxes, "train", imgsz=64, augment=True, hyp=AugmentConfig(copy_paste=0.5))
        DetectionDataset(boxes, "val", imgsz=64, hyp=AugmentConfig(copy_paste=0.5))      # no augmentation: silent
    said = [r.getMessage() for r in caplog.records if "copy_paste" in r.getMessage()]
    assert len(said) == 1 and "copy_paste 0.5 is off" in said[0] and "(train)" in said[0]
    assert "masks" not in ds[0]


@pytest.fixture(scope="module")
def seg_mixed(tmp_path_factory, seg_many):
    """seg_many with every other row of each label file a box row (its outline's box): a mixed set."""
    import shutil

    root = tmp_path_factory.mktemp("seg-mixed") / "set"
    shutil.copytree(Path(seg_many).parent, root)
    for path in (root / "labels").rglob("*.txt"):
        rows = []
        for k, line in enumerate(path.read_text().splitlines()):
            values = np.array(line.split()[1:], float).reshape(-1, 2)
            (x1, y1), (x2, y2) = values.min(0), values.max(0)
            rows.append(line if k % 2 else f"{line.split()[0]} {(x1 + x2) / 2} {(y1 + y2) / 2} {x2 - x1} {y2 - y1}")
        path.write_text("\n".join(rows) + "\n")
    (root / "data.yaml").write_text((root / "data.yaml").read_text().replace(str(Path(seg_many).parent), str(root)))
    return root / "data.yaml"


@pytest.mark.parametrize("mixed", [False, True], ids=["polygons", "box-rows-too"])
def test_rows_a_warp_cannot_show_are_skipped_without_changing_an_item(seg_many, seg_mixed, mixed, monkeypatch):
    """A Mosaic's rows whose outline (a box row: its box) lands wholly off the warped output are not resampled
    (``segment_items._mosaic_polygons`` given the warp's plan): every item, image, boxes and masks, is the one
    made with all rows; a box row keeps a box and gets no mask pixel."""
    from yolokit.data.augment import segment_items

    hyp = AugmentConfig(mosaic=1.0, degrees=10.0, shear=2.0, translate=0.2, scale=0.5, fliplr=0.5)
    ds = DetectionDataset(seg_mixed if mixed else seg_many, "train", imgsz=96, augment=True, hyp=hyp, segments=True,
                          buffer_size=0, overlap_mask=False)
    skipped, original = [], segment_items._mosaic_polygons

    def counted(ds, rows, canvas, plan=None):
        out = original(ds, rows, canvas, plan)
        skipped.append(int((~out[2]).sum()))
        return out

    monkeypatch.setattr(segment_items, "_mosaic_polygons", counted)
    items = [ds[i] for i in range(len(ds))]
    monkeypatch.setattr(segment_items, "_mosaic_polygons", lambda ds, rows, canvas, plan=None:
                        original(ds, rows, canvas))
    for i, item in enumerate(items):
        again = ds[i]
        assert all(torch.equal(item[k], again[k]) for k in ("image", "boxes", "classes", "masks", "mask_rows")), i
    assert sum(skipped) >= 3
    rows = torch.cat([item["mask_rows"] for item in items])
    assert rows.any() and (~rows).any() == mixed
    for item in items:
        box_rows = ~item["mask_rows"]
        assert item["masks"][box_rows].sum() == 0
        assert (item["boxes"][box_rows, 2:] > item["boxes"][box_rows, :2]).all()


def test_a_warp_shows_a_box_unless_all_its_corners_land_a_pixel_beyond_one_edge():
    """``segment_items._shown`` (each box's warped extent in one product) against the definition: the four
    corners through the plan, a box hidden when all four lie more than a pixel beyond one edge; plans that
    rotate by any angle (coefficients of either sign), shear and scale, boxes around and across the edges."""
    from yolokit.data.augment.segment_items import _shown
    from yolokit.data.augment.transforms import affine_plan

    rng = np.random.default_rng(0)
    hidden = 0
    for _ in range(40):
        plan = affine_plan(rng, (128, 128), (64, 64), degrees=180.0, translate=0.5, scale=0.9, shear=20.0,
                           perspective=0.0)
        lo = rng.uniform(-80, 200, (300, 2))
        boxes = np.concatenate([lo, lo + rng.uniform(0, 60, (300, 2))], 1)
        corners = np.stack([boxes[:, [0, 1]], boxes[:, [2, 1]], boxes[:, [0, 3]], boxes[:, [2, 3]]], 1)
        xy = corners @ plan.box_m[:2, :2].T + plan.box_m[:2, 2]
        h, w = plan.out_shape
        want = ~((xy[..., 0] < -1).all(1) | (xy[..., 1] < -1).all(1) | (xy[..., 0] > w + 1).all(1) |
                 (xy[..., 1] > h + 1).all(1))
        np.testing.assert_array_equal(_shown(boxes, plan), want)
        hidden += int((~want).sum())
    assert 0.2 < hidden / (40 * 300) < 0.9


def test_a_nine_image_item_carries_each_mask_with_its_object(seg):
    """Items of nine images through a rotating, scaling warp and flips: every mask covers one object's colour,
    and items hold rows of several samples."""
    hyp = AugmentConfig(mosaic=1.0, mosaic_tiles=9, degrees=10.0, translate=0.1, scale=0.2, fliplr=0.5)
    ds = DetectionDataset(seg, "train", imgsz=96, augment=True, hyp=hyp, segments=True, mask_ratio=1,
                          overlap_mask=False, buffer_size=0)
    checked, most = 0, 0
    for i in range(len(ds)):
        item = ds[i]
        assert item["image"].shape == (3, 96, 96) and len(item["masks"]) == len(item["boxes"])
        most = max(most, len(item["boxes"]))
        for m in item["masks"].numpy():
            if cv2.erode(m, np.ones((5, 5), np.uint8)).sum() >= 20:
                assert _object_like(item["image"], m), i
                checked += 1
    assert checked >= 10 and most >= 3              # one object an image: rows of three samples and more


@pytest.mark.gpu
def test_the_device_path_on_cuda_gives_the_workers_masks_and_images_within_a_grey_level(seg_many):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (gpu marker)")
    batches = []
    for on in ("workers", "device"):
        ds = DetectionDataset(seg_many, "train", imgsz=64, augment=True, segments=True,
                              hyp=AugmentConfig(mixup=0.5, degrees=10.0, flipud=0.5))
        batches.append(next(iter(build_dataloader(ds, 8, workers=0, seed=4, uint8_images=True, augment_on=on))))
    a, b = batches
    moved = to_device(b, "cuda")
    assert moved["masks"].is_cuda and torch.equal(moved["masks"].cpu(), a["masks"])
    assert torch.equal(moved["targets"].cpu(), a["targets"])
    diff = (moved["images"].mul(255).round().cpu().int() - a["images_uint8"].int()).abs()
    assert diff.float().mean((1, 2, 3)).max() <= 1.0


def test_a_mosaics_partners_find_their_outlines_resampled_while_in_the_buffer(tmp_path, monkeypatch):
    """Each image's outlines are resampled once while it is in the buffer of recent images, from which a Mosaic
    draws its partners (``segment_items._resampled``), even when the cache cannot hold the set: past the first
    items, whose partners come from anywhere, an item resamples its own image only (the cache once kept the
    recently *used* images where the buffer keeps the recently *decoded* ones: 1.6 an item). The cache stays
    within its bytes."""
    from yolokit.data.augment import segment_items
    from yolokit.data.sources.segments import Segments

    root = make_shapes(tmp_path / "set", n_train=48, n_val=2, imgsz=64, segments=True)
    ds = DetectionDataset(root, "train", imgsz=64, augment=True, segments=True, buffer_size=16,
                          hyp=AugmentConfig(mosaic=1.0, mixup=0.0))
    rows = sorted((len(ds.index.segments.extents(i)) for i in range(len(ds))), reverse=True)
    budget = sum(rows[:ds.buffer_size + 4]) * segment_items.POINTS * 2 * 4      # the buffer's fits, the set's not
    assert budget < sum(rows) * segment_items.POINTS * 2 * 4
    monkeypatch.setattr(segment_items, "OUTLINE_CACHE_BYTES", budget)
    opened, original, item = [], Segments.extents, [0]
    monkeypatch.setattr(Segments, "extents", lambda self, i: opened.append((item[0], int(i))) or original(self, i))
    for i in range(len(ds)):
        item[0] = i
        ds[i]
        kept = ds.__dict__["_resampled_rows"]
        assert ds._resampled_bytes == sum(e[0].nbytes for e in kept.values()) <= budget
    early = ds.buffer_size // 4                     # the first items: partners drawn from the whole set
    late = [(i, j) for i, j in opened if i > early]
    assert all(i == j for i, j in late) and len(late) > len(ds) // 2            # only an item's own image
    assert len(kept) < len(ds)                                                 # and older images went


def test_a_set_within_the_outline_cache_is_resampled_once_for_all_epochs(tmp_path, monkeypatch):
    """Outlines are kept across epochs while they fit (``OUTLINE_CACHE_BYTES``): each row is resampled once in two
    epochs (the second resamples only rows the first never showed), and the second epoch's items equal those
    of a dataset that resamples every time (a cache of no bytes)."""
    from yolokit.data.augment import polygons, segment_items

    root = make_shapes(tmp_path / "set", n_train=24, n_val=2, imgsz=64, segments=True)

    def make():
        return DetectionDataset(root, "train", imgsz=64, augment=True, segments=True, buffer_size=8,
                                hyp=AugmentConfig(mosaic=1.0, mixup=0.0))

    calls = []
    original = polygons.resampled_rows
    monkeypatch.setattr(segment_items, "resampled_rows", lambda rows: calls.append(len(rows)) or original(rows))
    ds = make()
    first = [ds[i] for i in range(len(ds))]
    once = sum(calls)
    ds.set_epoch(1)
    second = [ds[i] for i in range(len(ds))]
    kept = ds.__dict__["_resampled_rows"].values()
    assert len(kept) == len(ds) and sum(calls) == sum(int((done & has).sum()) for _, has, _, done, _ in kept)
    assert all(left == int((has & ~done).sum()) for _, has, _, done, left in kept)   # the count of rows to come
    assert 0 < sum(calls) - once < once                                        # each row once, in either epoch
    calls.clear()
    monkeypatch.setattr(segment_items, "OUTLINE_CACHE_BYTES", 0)
    fresh = make()
    fresh.set_epoch(1)
    again = [fresh[i] for i in range(len(fresh))]
    assert sum(calls) > 0 and len(fresh.__dict__["_resampled_rows"]) == 1     # only the item's own image is kept
    for a, b in zip(second, again, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("image", "boxes", "classes", "masks", "mask_rows"))
    assert any(not torch.equal(a["masks"], b["masks"]) for a, b in zip(first, second, strict=True))
