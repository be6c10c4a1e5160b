"""Batches: collate to the batch contract, and build_dataloader (samplers: `yolokit.data.samplers`).

A batch is a dict:
    images       float32 Tensor[B, 3, H, W] in [0, 1], RGB
    targets      float32 Tensor[N, 6] rows (image_index, class, x1, y1, x2, y2), input pixels
    paths        list[str]
    orig_shapes  list[(h, w)]
    ratio_pad    list[((ratio_w, ratio_h), (pad_w, pad_h))]: input = original * ratio + pad
    indices      list[int], dataset indices (e.g. for `dataset.image_ids`)
    max_boxes    int, most boxes in one image (losses pad to it without reading the device)
    masks        segmentation sets only (`DetectionDataset(segments=True)`): index maps uint8
                 Tensor[B, H/r, W/r] (int32 past 255 objects in an image), value k + 1 where the
                 image's row k is; or, without `overlap_mask`, uint8 Tensor[N, H/r, W/r], one per row
    mask_rows    segmentation sets only: bool Tensor[N], False for a row without a polygon

`build_dataloader(..., uint8_images=True)` yields `images_uint8` (uint8) instead of
`images`, for a much faster loader; `to_device(batch, device)` gives the contract back.
With `hsv_on_device=True` as well, the batch also carries `hsv_lut` uint8 Tensor[B, 3, 256]
and its `images_uint8` are before the HSV step, which `to_device` applies on the device
(`yolokit.data.augment.color`: the same images the workers would have made).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from yolokit.data.augment.color import apply_hsv_lut_batch
from yolokit.data.augment.device_augment import augment_batch
from yolokit.data.augment.recipes import RECIPE_KEY, collate_recipes
from yolokit.data.augment.segment_items import collate_masks, mask_parts
from yolokit.data.buffers import SLOT_KEY, BatchBuffers, Returning, fresh_shared_parts
from yolokit.data.dataset import DetectionDataset
from yolokit.data.samplers import (  # noqa: F401 (epoch_steps re-exported)
    AspectRatioBatchSampler,
    RectBatchSampler,
    ShardedBatchSampler,
    epoch_steps,
)
from yolokit.data.sources.images import PAD_VALUE
from yolokit.data.start_method import worker_context
from yolokit.data.store.prefetch import Prefetching, prefetching
from yolokit.data.workers import init_worker, signals_deferred


def _collate(items: list[dict], as_float: bool, buffers: BatchBuffers | None = None) -> dict:
    if items and RECIPE_KEY in items[0]:               # augment_on="device": the pixels are to_device's
        batch = collate_recipes(items, buffers)
        if "masks" in items[0]:
            h, w = (int(v) for v in batch["aug_shape"].max(0))
            batch.update(collate_masks(items, h, w))
        return batch
    b = len(items)
    h = max(it["image"].shape[1] for it in items)
    w = max(it["image"].shape[2] for it in items)
    shape, dtype = (b, 3, h, w), torch.float32 if as_float else torch.uint8
    # the batch's tensors in one buffer: the images, the targets, a segmentation batch's masks and their rows
    parts = [(shape, dtype), ((sum(len(it["classes"]) for it in items), 6), torch.float32)]
    if "masks" in items[0]:
        parts += mask_parts(items, h, w)
    tensors, slot = (fresh_shared_parts(parts), None) if buffers is None else buffers.empty_parts(parts)
    images, targets = tensors[:2]
    pad = PAD_VALUE / 255 if as_float else PAD_VALUE
    rows = []
    for i, it in enumerate(items):
        im = it["image"]
        ih, iw = im.shape[1:]
        if (ih, iw) != (h, w):
            images[i].fill_(pad)
        if as_float:
            images[i, :, :ih, :iw].copy_(im).mul_(1 / 255)  # per image: stays in cache
        else:
            images[i, :, :ih, :iw].copy_(im)
        g = len(it["classes"])
        if g:
            rows.append(torch.cat([torch.full((g, 1), float(i)),
                                   it["classes"].reshape(g, 1).float(), it["boxes"].float()], 1))
    luts = [it.get("hsv_lut") for it in items]
    if rows:
        torch.cat(rows, out=targets)
    masks = collate_masks(items, h, w, out=tensors[2:]) if len(tensors) > 2 else {}
    batch = {
        "images" if as_float else "images_uint8": images,
        "targets": targets,
        "paths": [it["path"] for it in items],
        "orig_shapes": [tuple(it["orig_shape"]) for it in items],
        "ratio_pad": [it["ratio_pad"] for it in items],
        "indices": [int(it["index"]) for it in items],
        "max_boxes": max((len(it["classes"]) for it in items), default=0),
        **masks,
    }
    if any(lut is not None for lut in luts):           # the HSV step left to to_device
        if as_float or any(lut is None for lut in luts):
            raise ValueError("items with hsv_lut (a dataset with hsv_in_batch) need collate_uint8, "
                             "all of them, and to_device to apply the tables")
        batch["hsv_lut"] = torch.stack(luts)
    if slot is not None:
        batch[SLOT_KEY] = slot                       # the loader takes it out (BatchBuffers.received)
    return batch


class _Collate:
    """`collate` / `collate_uint8` writing into the workers' reused buffers (`yolokit.data.buffers`)."""

    def __init__(self, as_float: bool, buffers: BatchBuffers | None) -> None:
        self.as_float, self.buffers = as_float, buffers

    def __call__(self, items: list[dict]) -> dict:
        return _collate(items, self.as_float, self.buffers)


def collate(items: list[dict]) -> dict:
    """Stack dataset items into a batch (see the module docstring).

    Images of different sizes (rect batches) are padded on the right and bottom
    with the letterbox grey, which leaves every `ratio_pad` valid. Holds no state.

    Args:
        items: DetectionDataset items.

    Returns:
        the batch dict; `images` Tensor[B, 3, H, W] float32 in [0, 1].
    """
    return _collate(items, as_float=True)


def collate_uint8(items: list[dict]) -> dict:
    """Like `collate`, but the images stay uint8, under the key `images_uint8`.

    A quarter of the bytes to write and pass between processes (the float batch
    costs about a third of the loader's throughput on a 2-core machine); convert
    on the device with `to_device`. The key differs on purpose: code that expects
    the float `images` fails loudly instead of training on 0..255 values.

    Returns:
        the batch dict with `images_uint8` uint8 Tensor[B, 3, H, W] instead of `images`.
    """
    return _collate(items, as_float=False)


def to_device(batch: dict, device: torch.device | str, *, non_blocking: bool = False, compiled: bool = False) -> dict:
    """Move a batch's tensors to `device`; uint8 images become float `images` in [0, 1] there.

    Args:
        batch: from `collate` or `collate_uint8`.
        device: target device.
        non_blocking: asynchronous copies (useful with pinned memory).
        compiled: the device's augmentation (the pass, or the HSV step) through ``torch.compile``
            (`yolokit.data.augment.fused`): fused kernels, the same images.

    Returns:
        a new dict holding the batch contract (`images` float32 Tensor[B, 3, H, W] in [0, 1],
        `targets` Tensor[N, 6]) on `device`; the other keys unchanged. A batch with `hsv_lut`
        (`hsv_on_device`) gets its HSV step here, on the device, and loses the key.
    """
    out = {k: v for k, v in batch.items() if k not in ("images_uint8", "hsv_lut") and not k.startswith("aug_")}
    if "aug_tiles" in batch:                           # augment_on="device": the whole augmentation here
        out["images"] = augment_batch(batch, device, compiled=compiled).float().mul_(1 / 255)
    elif "images_uint8" in batch:
        images = batch["images_uint8"].to(device, non_blocking=non_blocking)
        if "hsv_lut" in batch:
            images = apply_hsv_lut_batch(images, batch["hsv_lut"].to(device, non_blocking=non_blocking),
                                         compiled=compiled)
        out["images"] = images.float().mul_(1 / 255)
    else:
        out["images"] = batch["images"].to(device, non_blocking=non_blocking)
    out["targets"] = batch["targets"].to(device, non_blocking=non_blocking)
    for key in ("masks", "mask_rows"):                 # a segmentation batch's
        if key in batch:
            out[key] = batch[key].to(device, non_blocking=non_blocking)
    return out


class DetectionLoader(DataLoader):
    """A DataLoader that knows its epoch.

    Each `iter(loader)` runs one epoch: the one given to `set_epoch`, else the
    previous one plus 1 (starting at 0). The epoch reaches the sampler (shuffle
    order) and the dataset's shared state (worker generators), persistent workers
    included. `set_epoch(epoch, start_step=k)` resumes an epoch after its first `k`
    optimizer steps (a `ShardedBatchSampler` leaves their micro-batches out; their
    images are never decoded); the iteration after it starts at step 0 again.

    An iteration draws the workers' base seed from the loader's own generator, seeded
    from (`seed`, epoch), not from the global torch RNG: loading leaves the global RNG
    as it was, and an epoch's workers get the same seeds whether or not it is resumed.

    Workers start by the method `yolokit.data.start_method.worker_context` picks when they start
    (a dataset defined in a notebook reaches them by fork, or by value), from the one it was given.
    """

    seed: int = 0

    _epoch: int = 0
    _epoch_given: bool = True
    _start_step: int = 0
    _buffers: BatchBuffers | None = None     # the workers' reused batch buffers (build_dataloader)
    chunks_ahead: int = 0                    # remote shards: chunks fetched ahead of the workers (prefetch.py)
    _asked: tuple = ()                       # (the multiprocessing_context given,) once workers have started

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Use this epoch for the next iteration, from optimizer step ``start_step`` on."""
        if start_step and not isinstance(self.batch_sampler, ShardedBatchSampler):
            raise ValueError("start_step needs a ShardedBatchSampler (a training loader)")
        self._epoch, self._epoch_given, self._start_step = int(epoch), True, int(start_step)
        if isinstance(self.batch_sampler, ShardedBatchSampler):   # len() counts what the iteration yields
            self.batch_sampler.set_epoch(self._epoch, self._start_step)

    @property
    def epoch(self) -> int:
        return self._epoch

    def close(self) -> None:
        """End the worker processes now. Persistent workers otherwise live as long as the loader
        (a script's exit ends them too); the next iteration starts new ones."""
        iterator, self._iterator = self._iterator, None
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()

    def _get_iterator(self):
        if self.num_workers > 0:                   # before any worker starts: how they start
            self._asked = self._asked or (self.multiprocessing_context,)
            self.multiprocessing_context = worker_context(self._asked[0], (self.dataset, self.collate_fn,
                                                                           self.worker_init_fn))
        return super()._get_iterator()

    def __iter__(self):
        if not self._epoch_given:
            self._epoch, self._start_step = self._epoch + 1, 0
        self._epoch_given = False
        sampler = self.batch_sampler if isinstance(self.batch_sampler, (AspectRatioBatchSampler, ShardedBatchSampler)) \
            else self.sampler
        if isinstance(sampler, ShardedBatchSampler):
            sampler.set_epoch(self._epoch, self._start_step)
        elif hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self._epoch)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self._epoch)
        if self.generator is not None:
            self.generator.manual_seed(self.seed * 100_003 + self._epoch)
        ahead = prefetching(self.dataset, self.batch_sampler, self.chunks_ahead,   # remote shards: chunks
                            self.num_workers * (self.prefetch_factor or 0))          # fetched ahead
        with signals_deferred(self.num_workers > 0):   # workers may start here
            batches = super().__iter__()
        batches = batches if self._buffers is None else Returning(batches, self._buffers)
        return batches if ahead is None else Prefetching(batches, ahead)


def build_dataloader(
    dataset: DetectionDataset,
    batch_size: int = 16,
    *,
    workers: int | None = None,
    shuffle: bool | None = None,
    seed: int = 0,
    distributed: bool | None = None,
    drop_last: bool = False,
    pin_memory: bool | None = None,
    persistent_workers: bool | None = None,
    prefetch_factor: int = 2,
    uint8_images: bool = False,
    multiprocessing_context: str | None = None,
    accumulate: int = 1,
    whole_steps: bool = False,
    rank: int | None = None,
    world_size: int | None = None,
    rect: bool | None = None,
    stride: int | None = None,
    hsv_on_device: bool = False,
    augment_on: str = "workers",
    chunks_ahead: int = 2,
) -> DetectionLoader:
    """A DataLoader over a DetectionDataset that yields the batch contract.

    Args:
        dataset: the dataset (its seed and rank are set here: one loader per dataset).
        batch_size: images per batch (per process when distributed).
        workers: worker processes; default min(8, CPUs per process).
        shuffle: default True when the dataset augments (rect training: the order of its
            fixed batches); rect evaluation never shuffles.
        seed: base seed of the shuffle order and of the augmentation.
        distributed: shard across processes; default: when torch.distributed is
            initialized. Rect evaluation: each rank takes every world_size-th batch.
            Otherwise a `ShardedBatchSampler`: one process with `accumulate * world_size`
            accumulation steps sees the same micro-batches as all ranks together;
            nothing is padded or dropped, so ranks may get unequal counts.
        drop_last: drop the last incomplete batch.
        pin_memory: default True when CUDA is available.
        persistent_workers: keep workers between epochs; default True when workers > 0.
        prefetch_factor: batches each worker prepares ahead.
        chunks_ahead: shards in a store: chunks of the coming batches this process downloads ahead of the
            workers, in the sampler's order and within the cache cap (`data.store.prefetch`); 0: none.
        uint8_images: batches carry `images_uint8` (see `collate_uint8`) for conversion on
            the device with `to_device`; much faster loading, same training input.
        multiprocessing_context: "fork", "spawn" or "forkserver" for the workers; default the platform's,
            unless the dataset refers to a notebook's classes or functions: then fork, or the dataset by
            value (`yolokit.data.start_method`). The shared epoch / Mosaic switch works with all three.
        accumulate: micro-batches per rank per optimizer step (see `ShardedBatchSampler`).
        whole_steps: every rank gets the same number of micro-batches (see `ShardedBatchSampler`).
        rank, world_size: this process and the number of processes, when the caller has
            worked them out (the trainer's runtime plan); default: the process group's.
        rect: aspect-ratio batches; default the dataset's `rect`. A dataset that does not
            augment must be built with `rect=True` (rect evaluation, `AspectRatioBatchSampler`).
            One that augments trains in rect batches: a `RectBatchSampler` (fixed batches of
            similar aspect, their order shuffled per epoch, shared out like the
            `ShardedBatchSampler`: the same steps, `accumulate`, `whole_steps`, resume), and
            the dataset letterboxes each image to its batch's shape (`set_rect_batches`).
        stride: with `rect`: the model's largest stride, which batch shapes (rect training) and
            each image's shape (rect evaluation) are multiples of; default the dataset's `stride`.
        hsv_on_device: with `uint8_images`, the workers draw each image's HSV gains but leave
            the HSV step to `to_device`, on the training device (a third of a cached Mosaic
            sample's worker time; see `yolokit.data.augment.color`). Sets the dataset's `hsv_in_batch`.
        augment_on: "workers" (the augmentation in the loader's workers) or "device": the workers
            draw every random number and make the labels as before (`yolokit.data.augment.recipes`) but ship
            recipes and JPEG bytes; `to_device` decodes and augments the batch on the training device
            (`yolokit.data.augment.device_augment`): the same labels, images within a grey level. An
            augmenting dataset only; not with albumentations.

    Returns:
        DetectionLoader; call `set_epoch(e)` before each epoch (or let it count).

    Examples:
        >>> loader = build_dataloader(ds, 16, workers=2, seed=0)  # doctest: +SKIP
        >>> batch = next(iter(loader)); batch["images"].shape  # doctest: +SKIP
        torch.Size([16, 3, 640, 640])
    """
    if distributed is None:
        distributed = dist.is_available() and dist.is_initialized()
    if rank is None or world_size is None:
        rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if workers is None:
        workers = min(8, max(1, (os.cpu_count() or 1) // world_size))
    augment = bool(getattr(dataset, "augment", False))
    if hsv_on_device and not uint8_images:
        raise ValueError("hsv_on_device needs uint8_images=True: to_device applies the HSV step")
    if hasattr(dataset, "hsv_in_batch"):
        dataset.hsv_in_batch = bool(hsv_on_device)
    if augment_on not in ("workers", "device"):
        raise ValueError(f"augment_on must be 'workers' or 'device', got {augment_on!r}")
    if augment_on == "device" and augment and getattr(dataset, "albumentations", None) is not None:
        raise ValueError("augment_on='device' cannot run albumentations (numpy, in the workers): use 'workers'")
    hyp = getattr(dataset, "hyp", None)
    if augment_on == "device" and augment and getattr(hyp, "mosaic_tiles", 4) == 9:
        raise ValueError("augment_on='device' lays out Mosaics of 4 images only: mosaic_tiles=9 augments in the "
                         "loader's workers (augment_on='workers')")
    if augment_on == "device" and augment and getattr(dataset, "segments", False) and hyp.copy_paste > 0:
        raise ValueError(f"augment_on='device' cannot copy-paste (copy_paste {hyp.copy_paste:g} pastes pixels by "
                         "their outlines in the workers): use augment_on='workers' or copy_paste=0")
    if hasattr(dataset, "recipe_in_batch"):
        dataset.recipe_in_batch = augment_on == "device" and augment
    rect = bool(getattr(dataset, "rect", False)) if rect is None else rect
    if rect and not augment and not getattr(dataset, "rect", False):
        raise ValueError("rect evaluation letterboxes each image to its own shape: build the dataset with rect=True")
    if shuffle is None:
        shuffle = augment
    if rect and shuffle and not augment:
        raise ValueError("rect evaluation keeps its aspect-ratio order: use shuffle=False")
    if hasattr(dataset, "set_seed"):
        dataset.set_seed(seed)
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    if persistent_workers is None:
        persistent_workers = workers > 0
    buffers = BatchBuffers(workers, prefetch_factor + 2) if workers > 0 else None
    common = dict(num_workers=workers, collate_fn=_Collate(not uint8_images, buffers),
                  pin_memory=pin_memory, generator=torch.Generator(),
                  worker_init_fn=init_worker if workers > 0 else None,
                  persistent_workers=persistent_workers and workers > 0,
                  multiprocessing_context=multiprocessing_context if workers > 0 else None,
                  prefetch_factor=prefetch_factor if workers > 0 else None)
    groups = getattr(getattr(dataset, "index", None), "groups", None)   # shards: each image's chunk
    if rect and augment:
        batches = RectBatchSampler(dataset.shapes, batch_size, rank=rank, world_size=world_size,
                                   accumulate=accumulate, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                   whole_steps=whole_steps, groups=groups)
        dataset.set_rect_batches(batches.batches, stride)   # before any worker starts
        loader = DetectionLoader(dataset, batch_sampler=batches, **common)
    elif rect:
        dataset.stride = int(stride or dataset.stride)
        batches = AspectRatioBatchSampler(dataset.shapes, batch_size, rank=rank,
                                          world_size=world_size, groups=groups)
        loader = DetectionLoader(dataset, batch_sampler=batches, **common)
    else:
        batches = ShardedBatchSampler(len(dataset), batch_size, rank=rank, world_size=world_size,
                                      accumulate=accumulate, shuffle=shuffle, seed=seed,
                                      drop_last=drop_last, whole_steps=whole_steps, groups=groups)
        loader = DetectionLoader(dataset, batch_sampler=batches, **common)
    loader.seed, loader._buffers, loader.chunks_ahead = seed, buffers, chunks_ahead
    return loader
