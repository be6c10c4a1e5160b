"""DetectionDataset: one split of a source, loaded, augmented and ready to collate.

An item is a dict:
    image       uint8 Tensor[3, H, W], RGB
    boxes       float32 Tensor[G, 4], xyxy in pixels of `image`
    classes     int64 Tensor[G]
    path        str, the image file
    orig_shape  (h, w) of the original (upright) image
    ratio_pad   ((ratio_w, ratio_h), (pad_w, pad_h)): image = original * ratio + pad.
                Exact without augmentation; with it, the load scaling before Mosaic/affine.
    index       int, the dataset index actually returned (a different one when the
                requested image could not be read at run time: reported once)
    hsv_lut     only with `hsv_in_batch`: uint8 Tensor[3, 256], the image's HSV tables, not
                yet applied to `image` (`data.augment.color.apply_hsv_lut_batch` applies them)
    masks       `segments` only: the rows' masks (`data.augment.segment_items`), and `mask_rows` bool
                Tensor[G], False for a box row of a mixed set (its mask has no pixel)

Randomness is explicit: item i of epoch e draws from a numpy Generator seeded with
(seed, e, i), so an image is augmented the same way whichever process or worker loads it
(only the Mosaic partners drawn from a process's recent-image buffer depend on what that
process loaded before; `buffer_size=0` makes items independent of that too). `seed`,
`epoch` and the Mosaic switch live in a small shared-memory array, so changing them in
the main process reaches persistent DataLoader workers too.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import cv2
import numpy as np
import torch
from torch.utils.data import Dataset

from yolokit.data.augment.albu import Albumentations
from yolokit.data.augment.mosaic import mixup, mosaic_canvas
from yolokit.data.augment.recipes import train_recipe
from yolokit.data.augment.segment_items import check_segments, segment_item
from yolokit.data.augment.transforms import (
    AugmentConfig,
    apply_hsv_lut,
    hsv_lut,
    random_affine,
    random_flip,
    scale_boxes,
)
from yolokit.data.sources.images import ImageError, decode_image, letterbox
from yolokit.data.sources.labels import cache_home
from yolokit.data.sources.readers import DatasetError, load_split
from yolokit.data.sources.selection import select
from yolokit.data.store.cache import DiskCache, RamCache
from yolokit.data.store.stream import ShardLost
from yolokit.data.workers import SharedArray
from yolokit.ops.geometry import letterbox_plan

logger = logging.getLogger("yolokit.data")

_EPOCH, _MOSAIC, _SEED, _PASS = range(4)


class DetectionDataset(Dataset):
    """One split of a detection dataset.

    Args:
        source: a data.yaml path, a COCO instances json path, "shapes", or shards (`yolokit data
            shard`: their folder or ``s3://bucket/prefix``; a data.yaml's split may name them too).
        split: "train", "val", "test" (yaml sources and shards); ignored for a json.
        imgsz: training/inference size; images are resized so the long side is imgsz.
        augment: training augmentation (Mosaic, affine, HSV, flips, optional MixUp and
            albumentations); otherwise letterbox only.
        hyp: augmentation strengths (YOLOv8 defaults).
        rect: aspect-ratio batches; pair with build_dataloader, which groups images by
            aspect ratio. Without `augment` (rect evaluation) each image is letterboxed to
            its own stride-aligned shape. With `augment` (rect training) each image is
            letterboxed to its batch's shape (`set_rect_batches`, which build_dataloader
            calls), without Mosaic and MixUp; the affine step (scale, translation, ...),
            albumentations, HSV and flips act within that shape.
        stride: the model's largest stride (for `rect`).
        cache_images: keep the decoded, resized images: "ram" (or True), one copy in shared
            memory per machine, filled before the workers start; "disk", ``.npy`` files under
            ``cache_dir`` reused across runs (see ``yolokit.data.store.cache``); False: decode each time.
        cache_dir: the disk cache's folder (default ``cache_home() / "images"``).
        cache_peers: ``(local_rank, local_world, token)`` of the processes of this machine that
            share the RAM cache and split its filling (the disk cache's too); None: this one alone.
        buffer_size: when augmenting, each process keeps its last `buffer_size` decoded
            images and draws Mosaic partners among them, so a Mosaic decodes about one
            new image instead of four (0: partners drawn from the whole set, all decoded).
            The buffer is emptied at every pass, so passes stay reproducible.
        albumentations: an albumentations Compose / list (or an `Albumentations`),
            run after the affine step when augmenting.
        image_dir: COCO only, the image folder (guessed when None).
        label_cache: read/write the label cache.
        shards: images from shards: ``{"max_cache": "25GB", "cache_dir": ...}``, the local cache of
            remote chunks (`yolokit.data.store.stream.shard_index`).
        fraction, subset_seed, classes, single_cls: train on part of the split (a seeded
            share of the images, some classes' labels, or all classes as one); see
            `yolokit.data.sources.selection.select`. What they leave out is in `selection_notes`.
        segments, mask_ratio, overlap_mask: items carry masks at 1/`mask_ratio` of the image (one index
            map with `overlap_mask`), their polygons moved by every step (`data.augment.segment_items`).

    Attribute `hsv_in_batch` (default False; `build_dataloader(..., hsv_on_device=True)` sets it):
    an augmenting dataset draws each image's HSV gains as before but leaves them to the device:
    its items carry `hsv_lut` and an image without the HSV step.

    Examples:
        >>> ds = DetectionDataset("shapes", "val", imgsz=320)  # doctest: +SKIP
        >>> item = ds[0]; item["image"].shape, item["boxes"].shape  # doctest: +SKIP
        (torch.Size([3, 320, 320]), torch.Size([3, 4]))
    """

    def __init__(self, source: str | os.PathLike, split: str = "train", *, imgsz: int = 640,
                 augment: bool = False, hyp: AugmentConfig | None = None, rect: bool = False,
                 stride: int = 32, cache_images: bool | str = False, albumentations: Any = None,
                 image_dir: str | os.PathLike | None = None, label_cache: bool = True,
                 buffer_size: int = 64, fraction: float = 1.0, subset_seed: int = 0,
                 classes: Sequence[int] | None = None, single_cls: bool = False,
                 cache_dir: str | os.PathLike | None = None, cache_peers: tuple[int, int, str] | None = None,
                 shards: dict | None = None, segments: bool = False, mask_ratio: int = 4,
                 overlap_mask: bool = True) -> None:
        self.index, self.selection_notes = select(
            load_split(source, split, image_dir=image_dir, cache=label_cache, shards=shards), fraction=fraction,
            seed=subset_seed, classes=classes, single_cls=single_cls)
        self.segments, self.mask_ratio, self.overlap_mask = bool(segments), int(mask_ratio), bool(overlap_mask)
        self.names = self.index.names
        self._groups = self.index.groups        # shards: each image's chunk (Mosaic partners come from it)
        self.imgsz, self.augment, self.rect, self.stride = imgsz, augment, rect, stride
        self._rect_shapes: np.ndarray | None = None  # rect training: (h, w) of each image's batch
        self.hyp = hyp or AugmentConfig()
        check_segments(self, f"{source} ({split})", albumentations)
        if albumentations is not None and not isinstance(albumentations, Albumentations):
            albumentations = Albumentations(albumentations)
        self.albumentations = albumentations
        self._state = SharedArray("q", [0, 1, 0, 0])   # epoch, mosaic, seed, pass
        self.hsv_in_batch = False   # HSV tables drawn here, applied on the device (build_dataloader's hsv_on_device)
        self.recipe_in_batch = False  # augment_on="device": items carry recipes (data.augment.recipes), no pixels
        self._pass: int | None = None  # the pass this process's buffer belongs to
        self._warned: set[str] = set()
        mode = {True: "ram", False: None, None: None}.get(cache_images, cache_images)
        if mode not in (None, "ram", "disk"):
            raise ValueError(f"cache must be 'ram', 'disk' or off (False), got {cache_images!r}")
        self.buffer_size = buffer_size if augment and not mode else 0
        self._buffer: dict[int, np.ndarray] = {}
        self._ram: RamCache | None = None
        self._disk: DiskCache | None = None
        local_rank, local_world, _ = cache_peers or (0, 1, "")
        if mode == "ram":
            self._ram = RamCache(self.index.shapes, imgsz, self._read_resized, peers=cache_peers)
        elif mode == "disk":
            self._disk = DiskCache(self.index.paths, imgsz, cache_dir or cache_home() / "images",
                                   stamp=None if self.index.store is None else self.index.stamp)
            self._disk.fill(range(local_rank, len(self), local_world), self._read_resized,
                            threads=max(1, min(8, (os.cpu_count() or 1) // local_world)), progress=local_rank == 0)

    @property
    def mosaic(self) -> bool:
        """Mosaic on/off (shared with workers); off also when hyp.mosaic is 0, and never used with `rect`."""
        return bool(self._state.array[_MOSAIC])

    @mosaic.setter
    def mosaic(self, on: bool) -> None:
        self._state.array[_MOSAIC] = int(bool(on))

    @property
    def epoch(self) -> int:
        return int(self._state.array[_EPOCH])

    def set_epoch(self, epoch: int) -> None:
        """Start a pass over the data: items draw from (seed, epoch, index) and every
        process empties its Mosaic buffer at its next item (shared with workers).

        Called by DetectionLoader at each `iter(loader)`, so a pass never depends on
        what was drawn before it.
        """
        self._state.array[_EPOCH] = int(epoch)
        self._state.array[_PASS] += 1

    def set_seed(self, seed: int) -> None:
        """Base seed of the augmentation (shared with workers)."""
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self._state.array[_SEED] = int(seed)

    @property
    def category_ids(self) -> list[int] | None:
        """COCO: json category id of each class index (for evaluation)."""
        return self.index.category_ids

    @property
    def image_ids(self) -> list[int] | None:
        """COCO: json image id of each dataset index."""
        return self.index.image_ids

    @property
    def shapes(self) -> np.ndarray:
        """int32 [n, 2] original `(h, w)` of every image."""
        return self.index.shapes

    def __len__(self) -> int:
        return len(self.index)

    def generator(self, index: int) -> np.random.Generator:
        """The Generator of item ``index`` in the current epoch, seeded from (seed, epoch, index)."""
        a = self._state.array
        if a[_PASS] != self._pass:  # a new pass: recent images of the last one are forgotten
            self._pass = int(a[_PASS])
            self._buffer.clear()
        return np.random.default_rng([int(a[_SEED]), int(a[_EPOCH]), int(index)])

    def rect_shape(self, i: int) -> tuple[int, int]:
        """The stride-aligned ``(h, w)`` image ``i`` is letterboxed to with `rect`: its batch's shape
        once `set_rect_batches` has run, else its own (long side imgsz, as rect evaluation gives it)."""
        if self._rect_shapes is not None:
            return tuple(int(v) for v in self._rect_shapes[i])
        return letterbox_plan(self.shapes[i], self.imgsz, stride=self.stride, auto=True).shape

    def set_rect_batches(self, batches: Sequence[Sequence[int]], stride: int | None = None) -> None:
        """Rect training: every image of a batch is letterboxed to that batch's one shape.

        A batch's shape is, side by side, the largest rect shape of its images (long side
        imgsz, the other side padded up to a multiple of `stride`: what rect evaluation pads
        each image to), so it is a multiple of the stride and holds each image at long side
        imgsz or less. Turns `rect` on. Call it before the loader's workers start
        (build_dataloader does, with its `RectBatchSampler`'s fixed batches).

        Args:
            batches: dataset indices of each batch (each image in one batch at most).
            stride: the model's largest stride; default the dataset's `stride`.
        """
        self.rect, self.stride = True, int(stride or self.stride)
        self._rect_shapes, self.buffer_size = None, 0     # no Mosaic: no partners to keep decoded
        self._buffer.clear()
        own = np.array([self.rect_shape(i) for i in range(len(self))], np.int64).reshape(-1, 2)
        shapes = own.copy()
        for batch in batches:
            members = np.asarray(batch, np.int64)
            if len(members):
                shapes[members] = own[members].max(0)
        self._rect_shapes = shapes

    def _warn_once(self, path: str, reason: str) -> None:
        if path not in self._warned:
            self._warned.add(path)
            logger.warning("excluded at run time: %s: %s (another image is used instead)",
                           path, reason)

    def _read_resized(self, i: int) -> np.ndarray:
        image = decode_image(self.index.image_bytes(i))
        h, w = image.shape[:2]
        r = self.imgsz / max(h, w)
        if r != 1:
            interp = cv2.INTER_LINEAR if (self.augment or r > 1) else cv2.INTER_AREA
            image = cv2.resize(image, (max(1, round(w * r)), max(1, round(h * r))),
                               interpolation=interp)
        return image

    def _remember(self, i: int, item: Any) -> Any:
        """``item`` (image ``i``, or its recipe source) into the recent-image buffer, oldest out first."""
        if self.buffer_size:
            self._buffer[i] = item
            if len(self._buffer) > self.buffer_size:
                del self._buffer[next(iter(self._buffer))]
        return item

    def load(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[float, float]]:
        """Image i resized to long side imgsz, with its labels.

        Returns:
            image [h, w, 3] BGR, boxes float32 [G, 4] in its pixels, classes int64 [G],
            and the ratio `(ratio_w, ratio_h)` from the original.

        Raises:
            ImageError: the file cannot be read now.
        """
        if self._ram is not None:               # None: it could not be read when caching; try again
            image = self._ram.get(i)
            image = self._read_resized(i) if image is None else image
        elif self._disk is not None:
            image = self._disk.get(i, self._read_resized)
        elif i in self._buffer:
            image = self._buffer[i]
        else:
            image = self._remember(i, self._read_resized(i))
        h0, w0 = (int(v) for v in self.index.shapes[i])
        h, w = image.shape[:2]
        if abs(h / w - h0 / w0) > 0.02 * h0 / w0:
            self._warn_shape(i, (h0, w0), image.shape[:2])
        ratio = (w / w0, h / h0)
        labels = self.index.labels[i]
        boxes = scale_boxes(labels[:, 1:5], ratio, (0, 0))
        return image, boxes, labels[:, 0].astype(np.int64), ratio

    def _warn_shape(self, i: int, recorded: tuple, got: tuple) -> None:
        path = self.index.paths[i]
        if path + "#shape" not in self._warned:
            self._warned.add(path + "#shape")
            logger.warning("%s: decoded size %s differs in aspect from the indexed %s; "
                           "boxes scaled per axis", path, got, recorded)

    def _load_any(self, i: int, load: Callable[[int], tuple] | None = None) -> tuple:
        """`load(i)` (default `self.load`; the recipes pass theirs), or the next readable image when i
        cannot be read (reported once), with the index read last."""
        load = load or self.load
        n, j = len(self), i
        for _ in range(n):
            try:
                return (*load(j), j)
            except ShardLost as err:            # a whole chunk (named once by the store): on after it
                after = int(np.searchsorted(self.index.items, err.next_item)) % n
                j = after if after != j else (j + 1) % n
            except ImageError as err:
                self._warn_once(self.index.paths[j], str(err))
                j = (j + 1) % n
        raise DatasetError("no image of the dataset can be read any more")

    def __getitem__(self, i: int) -> dict:
        rng = self.generator(i)
        lut = None
        if self.segments:
            return segment_item(self, i, rng)
        if self.augment and self.recipe_in_batch:
            return train_recipe(self, i, rng)
        if self.augment:
            image, boxes, classes, ratio_pad, i, lut = self._train_sample(i, rng)
        else:
            image, boxes, classes, ratio, i = self._load_any(i)
            image, (r2, pad) = letterbox(image, self.imgsz, stride=self.stride, auto=self.rect)
            boxes = scale_boxes(boxes, r2, pad)
            ratio_pad = ((ratio[0] * r2[0], ratio[1] * r2[1]), pad)
        return self.item(image, boxes, classes, ratio_pad, i, lut)

    def item(self, image: np.ndarray, boxes: np.ndarray, classes: np.ndarray, ratio_pad: tuple, i: int,
             lut: np.ndarray | None, **extra: torch.Tensor) -> dict:
        """An item (see the module docstring) of image ``i``'s final BGR pixels, rows and ``extra`` tensors."""
        chw = np.empty((3, *image.shape[:2]), np.uint8)   # BGR HWC -> RGB CHW: split into the planes
        cv2.split(np.ascontiguousarray(image), [chw[2], chw[1], chw[0]])   # (one copy; 2.5x a stack of splits)
        return {
            "image": torch.from_numpy(chw),
            "boxes": torch.from_numpy(np.ascontiguousarray(boxes, np.float32).reshape(-1, 4)),
            "classes": torch.from_numpy(np.ascontiguousarray(classes, np.int64).reshape(-1)),
            **extra,
            "path": self.index.paths[i],
            "orig_shape": tuple(int(v) for v in self.index.shapes[i]),
            "ratio_pad": ratio_pad,
            "index": i,
            **({} if lut is None else {"hsv_lut": torch.from_numpy(lut)}),   # only with hsv_in_batch
        }

    def _train_sample(self, i: int, rng: np.random.Generator):
        hyp = self.hyp
        image, boxes, classes, ratio_pad, i = self._geometric_view(i, rng)
        if hyp.mixup > 0 and not self.rect and rng.random() < hyp.mixup:   # rect: one batch shape, no MixUp
            other = self._geometric_view(int(self._anywhere(rng, i)), rng)
            image, boxes, classes = mixup((image, boxes, classes), other[:3], rng)
        if self.albumentations is not None:
            image, boxes, classes = self.albumentations(image, boxes, classes, rng)
        lut = hsv_lut(rng, h=hyp.hsv_h, s=hyp.hsv_s, v=hyp.hsv_v, hue=hyp.hue_mode)
        if lut is not None and not self.hsv_in_batch:
            image, lut = apply_hsv_lut(image, lut), None
        image, boxes = random_flip(image, boxes, rng, fliplr=hyp.fliplr, flipud=hyp.flipud)   # commutes with HSV
        return image, boxes, classes, ratio_pad, i, lut

    def _partners(self, rng: np.random.Generator, i: int | None = None) -> list[int]:
        """Image i's Mosaic partners (3, or 8 for 9 tiles): the buffer's once a quarter full, else `_anywhere`."""
        n = self.hyp.mosaic_tiles - 1
        if self.buffer_size and len(self._buffer) >= min(self.buffer_size, len(self)) // 4:
            keys = list(self._buffer)
            return [keys[k] for k in rng.integers(0, len(keys), n)]
        return [int(j) for j in self._anywhere(rng, i, n)]

    def _anywhere(self, rng: np.random.Generator, i: int | None, size: int | None = None):
        """Images drawn to go with image i (Mosaic partners, MixUp's other): any of the split; from shards,
        any of i's chunk, so that no other chunk is fetched for them."""
        g = self._groups
        if g is None or i is None:
            return rng.integers(0, len(self), size) if size is not None else rng.integers(len(self))
        lo, hi = int(np.searchsorted(g, g[i], "left")), int(np.searchsorted(g, g[i], "right"))
        return lo + (rng.integers(0, hi - lo, size) if size is not None else rng.integers(hi - lo))

    def _geometric_view(self, i: int, rng: np.random.Generator):
        """Mosaic + affine, or letterbox + affine; output imgsz square (rect: no Mosaic, the batch's shape)."""
        hyp, s = self.hyp, self.imgsz
        affine = dict(degrees=hyp.degrees, translate=hyp.translate, scale=hyp.scale,
                      shear=hyp.shear, perspective=hyp.perspective)
        if not self.rect and self.mosaic and hyp.mosaic > 0 and rng.random() < hyp.mosaic:
            image, boxes, classes, ratio, i = self._load_any(i)
            samples = [(image, boxes, classes)] + [self._load_any(j)[:3] for j in self._partners(rng, i)]
            canvas, boxes, classes = mosaic_canvas(samples, s, rng, tiles=hyp.mosaic_tiles)
            image, boxes, classes = random_affine(canvas, boxes, classes, rng,
                                                  out_shape=(s, s), **affine)
            return image, boxes, classes, (ratio, (0.0, 0.0)), i
        shape = self.rect_shape(i) if self.rect else (s, s)   # i's, even when another image stands in
        image, boxes, classes, ratio, i = self._load_any(i)
        image, (r2, pad) = letterbox(image, shape)
        boxes = scale_boxes(boxes, r2, pad)
        image, boxes, classes = random_affine(image, boxes, classes, rng, **affine)   # keeps the shape
        return image, boxes, classes, ((ratio[0] * r2[0], ratio[1] * r2[1]), pad), i
