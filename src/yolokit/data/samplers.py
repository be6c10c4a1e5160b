"""Batch samplers: which dataset indices each loader batch holds, on each rank.

:class:`ShardedBatchSampler` shares an epoch's micro-batches out among the processes so that
any number of them takes the same optimizer steps; :func:`epoch_steps` is the one count of an
epoch's steps; :class:`AspectRatioBatchSampler` groups images by aspect ratio for rect evaluation,
:class:`RectBatchSampler` for rect training (fixed groups, their order shuffled, shared out by step).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Sampler


def aspect_batches(shapes: np.ndarray, batch_size: int, groups: np.ndarray | None = None) -> list[list[int]]:
    """Image indices sorted by aspect ratio (h / w, a stable sort) and cut into batches of ``batch_size``.

    The last batch (the tallest images) may hold fewer. With ``groups`` (each image's chunk of shards,
    `SplitIndex.groups`) the images are sorted chunk by chunk instead, in the chunks' order, by aspect
    ratio within each: rising in the first chunk, falling in the second, and so on (so that a batch that
    straddles two chunks joins images of like shapes), then cut as before. The batches are as many and
    as large, and each reads at most two neighbouring chunks.

    Examples:
        >>> aspect_batches(np.array([[64, 48], [48, 64], [64, 64]]), 2)
        [[1, 2], [0]]
        >>> aspect_batches(np.array([[64, 48], [48, 64], [64, 64], [48, 64]]), 2, groups=np.array([0, 0, 1, 1]))
        [[1, 0], [2, 3]]
    """
    aspect = shapes[:, 0] / shapes[:, 1]
    if groups is None:
        order = np.argsort(aspect, kind="stable")
    else:
        _, chunk = np.unique(np.asarray(groups), return_inverse=True)
        order = np.lexsort((np.where(chunk % 2, -aspect, aspect), chunk))
    return [order[k:k + batch_size].tolist() for k in range(0, len(order), batch_size)]


def grouped_order(groups: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A seeded order of ``len(groups)`` items that visits the groups in a random order and shuffles the
    items within each (what keeps a process on a few chunks at a time)."""
    n = len(groups)
    _, group = torch.unique(groups, return_inverse=True)
    place = torch.empty(int(group.max()) + 1, dtype=torch.int64)
    place[torch.randperm(len(place), generator=generator)] = torch.arange(len(place))
    return torch.argsort(place[group] * n + torch.randperm(n, generator=generator))


class AspectRatioBatchSampler(Sampler[list[int]]):
    """Batches of images with similar aspect ratio, for rect evaluation (fixed order).

    Args:
        shapes: int [n, 2] `(h, w)` of each image.
        batch_size: images per batch.
        rank, world_size: under DDP each rank takes every world_size-th batch.
        groups: each image's chunk of shards: batches chunk by chunk (:func:`aspect_batches`), so that
            a pass reads each chunk once.
    """

    def __init__(self, shapes: np.ndarray, batch_size: int, *, rank: int = 0,
                 world_size: int = 1, groups: np.ndarray | None = None) -> None:
        self.batches = aspect_batches(shapes, batch_size, groups)[rank::world_size]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def epoch_steps(size: int, batch_size: int, *, world_size: int = 1, accumulate: int = 1, drop_last: bool = False,
                whole_steps: bool = False) -> int:
    """Optimizer steps in an epoch of ``size`` items as :class:`ShardedBatchSampler` shares them out.

    The one count of an epoch's steps: the sampler, the trainer's runtime plan (and from it
    the Accumulator and the learning-rate schedule) read it from here.

    Examples:
        >>> epoch_steps(100, 8, world_size=2, accumulate=2)   # 13 micro-batches, 4 per step
        4
    """
    group = world_size * accumulate
    return -(-_micro_batches(size, batch_size, group, drop_last, whole_steps) // group)


def _micro_batches(size: int, batch_size: int, group: int, drop_last: bool, whole_steps: bool) -> int:
    """Micro-batches of an epoch: ``size`` items in batches of ``batch_size``; with ``whole_steps`` only
    those of complete steps (``group`` micro-batches each)."""
    chunks = size // batch_size if drop_last else -(-size // batch_size)
    return chunks // group * group if whole_steps else chunks


class ShardedBatchSampler(Sampler[list[int]]):
    """Batches of an epoch, shared out so that any number of processes takes the same steps.

    The epoch's order (``randperm`` seeded with ``seed + epoch``, or the dataset order) is
    cut into micro-batches of ``batch_size``. Each optimizer step takes the next
    ``world_size * accumulate`` micro-batches; within a step, rank r gets micro-batches
    ``r * accumulate`` to ``(r + 1) * accumulate - 1``. So one process accumulating
    ``world_size * accumulate`` micro-batches sees exactly the micro-batches of all ranks,
    in rank order, step by step.

    Nothing is repeated or dropped (unlike ``DistributedSampler``'s padding): the last
    micro-batch may hold fewer images, and in the last step the remaining micro-batches go
    to the lowest ranks, so ranks may have fewer batches (or none) in it. ``len()`` is this
    rank's count; :class:`yolokit.accel.accumulation.Accumulator` keeps ranks stepping
    together.

    ``set_epoch(epoch, start_step=k)`` resumes an epoch after ``k`` optimizer steps: the
    micro-batches of those steps are left out of the iteration (their indices are never
    yielded, so no image of theirs is decoded) and ``len()`` counts the rest.

    Args:
        size: Number of dataset items.
        batch_size: Images per micro-batch.
        rank, world_size: This process and the number of processes.
        accumulate: Micro-batches per rank per optimizer step.
        shuffle: Random order per epoch.
        seed: Base seed of the order.
        drop_last: Drop the last micro-batch when it is not full.
        groups: Each item's group (shards: its chunk, `SplitIndex.groups`): shuffling visits the
            groups in a seeded order and shuffles the items within each, so a few chunks are read at
            a time; the order is still one over all ranks.
        whole_steps: Drop the micro-batches of an incomplete last step too, so every rank
            runs the same number of micro-batches (what SyncBatchNorm's collectives in
            forward and backward need); at most ``world_size * accumulate - 1`` micro-batches
            of each epoch are left out (a different set each epoch when shuffling).
    """

    def __init__(self, size: int, batch_size: int, *, rank: int = 0, world_size: int = 1, accumulate: int = 1,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, whole_steps: bool = False,
                 groups: np.ndarray | None = None) -> None:
        if batch_size < 1 or accumulate < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need batch_size >= 1, accumulate >= 1 and 0 <= rank < world_size, got "
                             f"{batch_size}, {accumulate}, {rank}, {world_size}")
        self.size, self.batch_size, self.rank, self.world_size = size, batch_size, rank, world_size
        self.accumulate, self.shuffle, self.seed, self.drop_last = accumulate, shuffle, seed, drop_last
        self.whole_steps = whole_steps
        self.groups = None if groups is None else torch.as_tensor(np.asarray(groups), dtype=torch.int64)
        if self.groups is not None and len(self.groups) != size:
            raise ValueError(f"groups: one per item, got {len(self.groups)} for {size} items")
        self.epoch, self.start_step = 0, 0

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """The epoch of the next iteration, leaving out the micro-batches of its first ``start_step`` steps."""
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        self.epoch, self.start_step = int(epoch), int(start_step)

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in an epoch (the same on every rank; :func:`epoch_steps`)."""
        return epoch_steps(self.size, self.batch_size, world_size=self.world_size, accumulate=self.accumulate,
                           drop_last=self.drop_last, whole_steps=self.whole_steps)

    def _mine(self) -> list[int]:
        """Indices of this rank's micro-batches among all the epoch's micro-batches."""
        group, first = self.world_size * self.accumulate, self.rank * self.accumulate
        total = _micro_batches(self.size, self.batch_size, group, self.drop_last, self.whole_steps)
        chunks = range(self.start_step * group, total)   # resuming: the first steps' chunks left out
        return [c for c in chunks if first <= c % group < first + self.accumulate]

    def order(self) -> torch.Tensor:
        """The epoch's order of the dataset's indices (the same on every rank)."""
        if not self.shuffle:
            return torch.arange(self.size)
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        if self.groups is None:
            return torch.randperm(self.size, generator=generator)
        return grouped_order(self.groups, generator)

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order()
        b = self.batch_size
        for c in self._mine():
            yield order[c * b:(c + 1) * b].tolist()

    def __len__(self) -> int:
        return len(self._mine())


class RectBatchSampler(ShardedBatchSampler):
    """Rect training: fixed aspect-ratio batches, their order shuffled per epoch, shared out by step.

    The images are sorted by aspect ratio and cut into batches of ``batch_size`` once
    (:func:`aspect_batches`, rect evaluation's grouping), so every image keeps one batch, and
    one batch shape, for the whole run (``DetectionDataset.set_rect_batches``). What changes
    per epoch is the order of the batches: a ``randperm`` of them seeded with ``seed + epoch``
    (the aspect order with ``shuffle=False``), the same on every rank and after a resume. The
    ordered batches are then the micro-batches of :class:`ShardedBatchSampler`: each optimizer
    step takes the next ``world_size * accumulate`` of them and rank r its ``accumulate``, so
    the counts (:func:`epoch_steps`), ``set_epoch(epoch, start_step=k)``, ``drop_last`` (the
    short batch is left out) and ``whole_steps`` mean what they mean there. The short batch,
    last in aspect order, may come at any step of an epoch.

    With ``groups`` (shards: each image's chunk) the batches are cut chunk by chunk
    (:func:`aspect_batches`) and their order visits the chunks in a seeded order, the batches of each
    chunk (those that start in it) shuffled, so that a step reads a few chunks, not many.

    Args:
        shapes: int [n, 2] ``(h, w)`` of each image.
        batch_size, rank, world_size, accumulate, shuffle, seed, drop_last, whole_steps, groups: as
            for :class:`ShardedBatchSampler`.
    """

    def __init__(self, shapes: np.ndarray, batch_size: int, **kwargs) -> None:
        super().__init__(len(shapes), batch_size, **kwargs)
        groups = None if self.groups is None else self.groups.numpy()
        batches = aspect_batches(np.asarray(shapes), batch_size, groups)
        self.batches = batches[:len(shapes) // batch_size] if self.drop_last else batches   # of every epoch
        self.batch_groups = None if groups is None else self.groups[[b[0] for b in self.batches]]

    def __iter__(self) -> Iterator[list[int]]:
        n = len(self.batches)
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        if not self.shuffle:
            order = list(range(n))
        elif self.batch_groups is None:
            order = torch.randperm(n, generator=generator).tolist()
        else:
            order = grouped_order(self.batch_groups, generator).tolist()
        for c in self._mine():
            yield list(self.batches[order[c]])
