"""Shared-memory batch buffers that loader workers reuse instead of making one per batch.

A worker hands its batch to the training process in shared memory. A new shared buffer per
batch is dear: PyTorch reserves the pages of each new ``/dev/shm`` file up front and every page
then faults on its first write, about 10 ms for a batch of 16 uint8 images at 640 px here
(0.6 ms an image, a sixth of a cached Mosaic sample's time), against 1 ms to write into a
buffer already mapped.

So each worker keeps up to ``slots`` buffers. A small shared table holds, per worker and slot,
0 (free) or the serial number of the batch the buffer holds. A worker writes a batch into a free
slot (a fresh, unkept buffer when none is free: it never waits), marks the slot with the batch's
serial and sends ``(slot, serial)`` with the batch under `SLOT_KEY`. In the training process
`BatchBuffers.received` takes that key out of each batch and frees the slot once nothing there
uses the buffer: at once when the pin-memory thread has copied the batch, else as soon as the
images' storage (with ``augment_on="device"``, the JPEG bytes') is gone (checked at every batch),
so a batch a user keeps is never written over.
A slot is freed only while it still holds that serial: a restarted worker's new buffer in the
same slot is not freed by the end of the old one.
"""

from __future__ import annotations

import itertools
import math
import multiprocessing as mp
import os
from multiprocessing.context import get_spawning_popen

import torch
from torch.utils.data import get_worker_info

try:
    from torch.multiprocessing.reductions import StorageWeakRef
except ImportError:   # pragma: no cover - not in this PyTorch: every batch gets a new buffer
    StorageWeakRef = None

SLOT_KEY = "_buffer_slot"
_kept: dict[int, dict[int, torch.UntypedStorage]] = {}    # this worker's buffers, per table and slot
_serials = itertools.count(1)


Part = tuple[tuple[int, ...], torch.dtype]    # a tensor's shape and dtype


def _layout(parts: list[Part]) -> tuple[list[int], int]:
    """Where tensors of ``parts`` lie one after another in one buffer: each one's byte offset (a multiple of 64),
    and the bytes of all."""
    offsets, end = [], 0
    for shape, dtype in parts:
        end = -(-end // 64) * 64
        offsets.append(end)
        end += math.prod(shape) * dtype.itemsize
    return offsets, end


def _in(storage: torch.UntypedStorage, parts: list[Part], offsets: list[int]) -> list[torch.Tensor]:
    return [torch.empty(0, dtype=dtype).set_(storage, at // dtype.itemsize, shape)
            for (shape, dtype), at in zip(parts, offsets, strict=True)]


def fresh_shared(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor, in new shared memory inside a DataLoader worker (what default_collate does)."""
    return fresh_shared_parts([(shape, dtype)])[0]


def fresh_shared_parts(parts: list[Part]) -> list[torch.Tensor]:
    """Empty tensors of ``parts`` (shape and dtype each), inside a DataLoader worker all in one new shared buffer:
    a batch's tensors cross to the training process as one file, not one each (each costs its file, its pages'
    first faults and the handing over of its descriptor: about 1 ms of CPU a batch for a segmentation batch's
    masks and row flags)."""
    if get_worker_info() is None:
        return [torch.empty(shape, dtype=dtype) for shape, dtype in parts]
    offsets, nbytes = _layout(parts)
    return _in(torch.UntypedStorage._new_shared(nbytes), parts, offsets)


class BatchBuffers:
    """Reusable shared batch buffers of a loader's workers (see the module docstring).

    Args:
        workers: the loader's worker processes.
        slots: buffers each worker keeps (batches in flight per worker, plus one the
            training process still holds).
    """

    def __init__(self, workers: int, slots: int) -> None:
        self.slots = slots
        self.table = mp.RawArray("q", max(1, workers * slots)) if StorageWeakRef is not None else None
        self._held: list[tuple[object, int, int]] = []     # training process: (storage ref, slot, serial)

    def __getstate__(self) -> dict:
        share = get_spawning_popen() is not None           # to a starting worker: the same table
        return {"slots": self.slots, "table": self.table if share else None}

    def __setstate__(self, state: dict) -> None:           # any other copy: its buffers are never reused
        self.slots, self.table, self._held = state["slots"], state["table"], []

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, tuple[int, int] | None]:
        """A tensor for a batch: in a worker, in one of its kept buffers when one is free.

        Returns:
            the tensor, and ``(slot, serial)`` to send with the batch (None: a fresh buffer).
        """
        tensors, slot = self.empty_parts([(shape, dtype)])
        return tensors[0], slot

    def empty_parts(self, parts: list[Part]) -> tuple[list[torch.Tensor], tuple[int, int] | None]:
        """:meth:`empty` of several tensors (shape and dtype each) in one buffer, the first of them the images
        (whose storage `received` watches: the buffer is one storage, so any of its tensors keeps it). A kept
        buffer too small for a batch is replaced by one larger than needed (an eighth, 1 MiB at most), so that
        batches of a few more rows or masks than the last do not each make a new one."""
        info = get_worker_info()
        if info is None or self.table is None:
            return fresh_shared_parts(parts), None
        offsets, nbytes = _layout(parts)
        kept = _kept.setdefault(id(self.table), {})
        for slot in range(info.id * self.slots, (info.id + 1) * self.slots):
            storage = kept.get(slot)
            if storage is not None and self.table[slot] != 0:
                continue                                    # the training process still has it
            if storage is None or storage.nbytes() < nbytes:
                storage = kept[slot] = torch.UntypedStorage._new_shared(nbytes + min(nbytes // 8, 1 << 20))
            serial = (os.getpid() << 40) | next(_serials)
            self.table[slot] = serial
            return _in(storage, parts, offsets), (slot, serial)
        return fresh_shared_parts(parts), None

    def received(self, batch: dict) -> dict:
        """In the training process: take the slot out of a batch, free the buffers nothing uses any more."""
        self.release_unused()
        slot = batch.pop(SLOT_KEY, None) if isinstance(batch, dict) else None
        if slot is None or self.table is None:
            return batch
        images = next((batch[k] for k in ("images_uint8", "images", "aug_jpeg") if k in batch), None)
        if images is None or images.is_pinned():            # the pin-memory thread copied it out
            # The pin thread hands a batch on only once its copy is made, and slots are freed only
            # here, so no worker writes this buffer again before the copy exists.
            self._free(*slot)
        else:
            self._held.append((StorageWeakRef(images.untyped_storage()), *slot))
        return batch

    def release_unused(self) -> None:
        """Free the slots whose buffers no tensor of this process uses any more."""
        held = []
        for ref, slot, serial in self._held:
            if ref.expired():
                self._free(slot, serial)
            else:
                held.append((ref, slot, serial))
        self._held = held

    def _free(self, slot: int, serial: int) -> None:
        if self.table[slot] == serial:                      # not a newer batch of a restarted worker
            self.table[slot] = 0


class Returning:
    """A loader iterator that passes each batch through `BatchBuffers.received`."""

    def __init__(self, batches, buffers: BatchBuffers) -> None:
        self._batches, self._buffers = batches, buffers

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self._batches)

    def __next__(self):
        return self._buffers.received(next(self._batches))
