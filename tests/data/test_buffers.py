"""Loader workers write batches into a few kept shared buffers, never over a batch still in use."""

from __future__ import annotations

import os

import pytest
import torch

from yolokit.data import DetectionDataset, build_dataloader


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


@pytest.mark.gpu
def test_pinned_batches_free_their_buffer_at_once(shapes_yaml):
    ds = DetectionDataset(shapes_yaml, "train", imgsz=64, augment=True)
    loader = build_dataloader(ds, 3, workers=2, seed=0, uint8_images=True, pin_memory=True)
    plain = build_dataloader(DetectionDataset(shapes_yaml, "train", imgsz=64, augment=True), 3, workers=0, seed=0,
                             uint8_images=True)
    batches = list(loader)                               # all kept: pinned copies, the buffers free again
    assert all(b["images_uint8"].is_pinned() for b in batches)
    assert list(loader._buffers.table) == [0] * 8
    for a, b in zip(batches, plain, strict=True):
        assert torch.equal(a["images_uint8"], b["images_uint8"])
