"""Loader workers write batches into a few kept shared buffers, never over a batch still in use."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.utils.data._utils.pin_memory as pin_memory_module

from yolokit.data import DetectionDataset, build_dataloader
from yolokit.data.buffers import SLOT_KEY


def _inode(images: torch.Tensor) -> int:
    fd, _ = images.untyped_storage()._share_fd_cpu_()    # the shared file the worker wrote the batch into
    return os.fstat(fd).st_ino


def test_spawned_workers_reuse_their_buffers(shapes_yaml):
    ds = DetectionDataset(shapes_yaml, "train", imgsz=64, augment=True)
    loader = build_dataloader(ds, 3, workers=2, seed=0, uint8_images=True, multiprocessing_context="spawn")
    inodes = [_inode(batch["images_uint8"]) for _ in range(3) for batch in loader]   # 8 batches an epoch
    assert len(inodes) == 24
    # per worker: 2 batches in flight, the one the loop holds, one dropped since the last batch: 4 buffers
    assert len(set(inodes)) <= 2 * 4
    loader.close()


def test_a_batch_or_a_view_the_user_keeps_is_never_written_over(shapes_yaml):
    ds = DetectionDataset(shapes_yaml, "train", imgsz=64, augment=True)
    loader = build_dataloader(ds, 3, workers=2, seed=0, uint8_images=True, multiprocessing_context="fork")
    kept = []
    for epoch in range(3):
        for k, batch in enumerate(loader):
            assert "_buffer_slot" not in batch
            if epoch == 0 and k in (1, 4):               # a whole batch, and a view of one image of another
                held = batch["images_uint8"] if k == 1 else batch["images_uint8"][2]
                kept.append((held, held.clone()))
    for held, copy in kept:                              # 2 more epochs later: as they were
        assert torch.equal(held, copy)
    del batch, held
    kept.clear()
    loader._buffers.release_unused()
    assert list(loader._buffers.table) == [0] * 8        # every buffer free once nothing uses it
    loader.close()


def test_without_workers_and_with_plain_collate_nothing_is_kept(shapes_yaml):
    ds = DetectionDataset(shapes_yaml, "train", imgsz=64, augment=True)
    loader = build_dataloader(ds, 4, workers=0, seed=0, uint8_images=True)
    assert loader._buffers is None and all("_buffer_slot" not in b for b in loader)


def _loader(shapes_yaml, pin: bool, batch_size: int = 3):
    ds = DetectionDataset(shapes_yaml, "train", imgsz=64, augment=True)
    return build_dataloader(ds, batch_size, workers=2, seed=0, uint8_images=True, pin_memory=pin,
                            multiprocessing_context="fork")


@pytest.mark.gpu
def test_pinned_batches_free_their_buffer_at_once(shapes_yaml):
    # The reference is the same 2-worker loader unpinned. A 0-worker loader gives other images:
    # Mosaic draws partners from each process's recent images (dataset.py), and the two workers'
    # recent images are not the one process's. On the CPU, over 3 epochs of this set: 3 of 24 batches
    # equal the 0-worker loader's, 24 of 24 another such 2-worker loader's.
    plain = _loader(shapes_yaml, pin=False)
    expected = [(b["images_uint8"].clone(), b["targets"].clone()) for b in plain]
    plain.close()
    loader = _loader(shapes_yaml, pin=True)
    batches = list(loader)                               # all kept: pinned copies
    assert all(b["images_uint8"].is_pinned() for b in batches)
    assert list(loader._buffers.table) == [0] * 8        # every buffer free while the copies are still held
    assert len(batches) == len(expected) == 8
    for b, (images, targets) in zip(batches, expected, strict=True):
        assert torch.equal(b["images_uint8"], images) and torch.equal(b["targets"], targets)
    loader.close()


_PINNED = "_pinned_by_the_test"


def test_the_pin_thread_copies_a_kept_buffer_before_it_is_freed(shapes_yaml, monkeypatch):
    """The pinned path on the CPU: the DataLoader's own pin-memory thread, with a stand-in pin.

    Without an accelerator the DataLoader never starts its pin-memory thread, so the test makes it
    think it has one. The stand-in `Tensor.pin_memory` copies and marks the copy, so that
    `is_pinned()` (what `BatchBuffers.received` asks) says True. The pin thread's step waits 5 ms
    before it copies, and checks, once the copy is made, that the batch's slot still holds the
    batch's serial: a slot freed before then could have been written over by its worker during the
    copy (freed and taken again, the slot would hold a newer serial; freed only, 0). Each worker
    keeps one buffer, so a worker writes a batch there again as soon as it is free, and every batch
    must still equal the unpinned loader's.
    """
    plain = _loader(shapes_yaml, pin=False, batch_size=2)
    expected = [(b["images_uint8"].clone(), b["targets"].clone()) for _ in range(4) for b in plain]
    plain.close()

    loader = _loader(shapes_yaml, pin=True, batch_size=2)
    loader._buffers.slots = 1                            # one kept buffer a worker (set before they start)
    table, in_kept, freed_early = loader._buffers.table, [], []
    pin_batch = pin_memory_module.pin_memory            # the pin thread's step (it recurses through the name)

    def slow_pin_batch(data, device=None):
        slot = data.get(SLOT_KEY) if isinstance(data, dict) else None
        if isinstance(data, dict) and "images_uint8" in data:
            in_kept.append(slot is not None)
            time.sleep(0.005)
        data = pin_batch(data, device)
        if slot is not None and table[slot[0]] != slot[1]:
            freed_early.append(slot)
        return data

    def pin(tensor, *args, **kwargs):
        copy = tensor.clone()
        setattr(copy, _PINNED, True)
        return copy

    is_pinned = torch.Tensor.is_pinned
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cpu"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda index: None)
    monkeypatch.setattr(pin_memory_module, "pin_memory", slow_pin_batch)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    monkeypatch.setattr(torch.Tensor, "is_pinned",
                        lambda self, *a, **k: getattr(self, _PINNED, False) or is_pinned(self, *a, **k))
    batches = []
    for _ in range(4):
        batches += list(loader)
        assert loader._iterator._pin_memory             # the DataLoader's pin-memory thread made the copies
    assert len(batches) == len(in_kept) == len(expected) == 48
    assert sum(in_kept) >= 16                           # a third or more came in a kept buffer
    assert freed_early == []
    assert all(b["images_uint8"].is_pinned() for b in batches)
    for b, (images, targets) in zip(batches, expected, strict=True):
        assert torch.equal(b["images_uint8"], images) and torch.equal(b["targets"], targets)
    assert list(loader._buffers.table) == [0] * 8        # every buffer free while the copies are still held
    loader.close()


def test_tensors_of_one_buffer_lie_apart_and_keep_their_values():
    """``buffers._layout``: each part at a multiple of 64 bytes after the one before; written one after another,
    no part changes another's bytes (dtypes of 1, 4 and 1 bytes, sizes not multiples of 64)."""
    from yolokit.data.buffers import _in, _layout

    parts = [((3, 5, 7), torch.uint8), ((11, 6), torch.float32), ((13,), torch.bool), ((2, 3), torch.int32)]
    offsets, nbytes = _layout(parts)
    assert offsets == [0, 128, 448, 512] and nbytes == 536
    tensors = _in(torch.UntypedStorage(nbytes), parts, offsets)
    values = [torch.arange(t.numel()).reshape(t.shape).to(t.dtype) if t.dtype != torch.bool else
              torch.arange(t.numel()) % 3 == 0 for t in tensors]
    for t, v in zip(tensors, values, strict=True):
        t.copy_(v)
    for (shape, _), t, v in zip(parts, tensors, values, strict=True):
        assert t.shape == shape and torch.equal(t, v)


@pytest.mark.parametrize("overlap", [True, False], ids=["index-map", "mask-per-row"])
def test_a_segmentation_batch_crosses_as_one_buffer_and_what_is_kept_is_never_written_over(tmp_path, overlap):
    """A worker's batch: images, targets, masks and mask rows in one shared buffer (one file to hand over, not
    four); the targets and masks a user keeps, without the images, stay as they were two epochs later, and the
    buffer is freed once nothing uses it. The rows of targets, masks and mask_rows agree."""
    from yolokit.data import make_shapes

    root = make_shapes(tmp_path / "seg", n_train=16, n_val=2, imgsz=64, segments=True)
    ds = DetectionDataset(root, "train", imgsz=64, augment=True, segments=True, overlap_mask=overlap)
    loader = build_dataloader(ds, 3, workers=2, seed=0, uint8_images=True, multiprocessing_context="fork")
    kept = []
    for epoch in range(3):
        for k, batch in enumerate(loader):
            storages = {batch[key].untyped_storage().data_ptr() for key in
                        ("images_uint8", "targets", "masks", "mask_rows")}
            assert len(storages) == 1
            n = len(batch["targets"])
            assert len(batch["mask_rows"]) == n and len(batch["masks"]) == (len(batch["images_uint8"]) if overlap
                                                                            else n)
            if overlap:                                  # each image's values 1..rows, its rows in order
                counts = torch.bincount(batch["targets"][:, 0].long(), minlength=len(batch["masks"]))
                assert all(int(m.max()) <= int(c) for m, c in zip(batch["masks"], counts, strict=True))
            if epoch == 0 and k in (1, 3):
                held = (batch["targets"], batch["masks"], batch["mask_rows"])
                kept.append((held, tuple(t.clone() for t in held)))
    assert len(kept) == 2
    for held, copy in kept:
        assert all(torch.equal(a, b) for a, b in zip(held, copy, strict=True))
    del batch, held
    kept.clear()
    loader._buffers.release_unused()
    assert list(loader._buffers.table) == [0] * 8
    loader.close()
