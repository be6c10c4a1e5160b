"""What part of a split trains: a seeded fraction of the images, some classes only, or one class.

``select`` returns a new :class:`~yolokit.data.sources.labels.SplitIndex` and the lines that say what
it left out; :class:`~yolokit.data.DetectionDataset` applies it before anything is decoded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from yolokit.data.sources.labels import SplitIndex

SINGLE_CLASS_NAME = "object"


def select(index: SplitIndex, *, fraction: float = 1.0, seed: int = 0, classes: Sequence[int] | None = None,
           single_cls: bool = False) -> tuple[SplitIndex, list[str]]:
    """The images and labels of ``index`` that train, and what was left out (one line each).

    Args:
        index: A split.
        fraction: Share of the images kept, in (0, 1]: ``round(fraction * n)`` images (at
            least 1) drawn with ``seed``, in their original order; the same on every process
            and after a resume, since it depends on the seed alone.
        seed: Seed of the draw.
        classes: Class ids kept. Labels of other classes are dropped (their objects are not
            relabelled, nor kept as boxes of some class); images keep their place, so an image
            left without labels trains as background. Class ids and names are unchanged.
        single_cls: Every label becomes class 0, named "object".

    Raises:
        ValueError: a fraction outside (0, 1], or a class id the split does not have.

    Examples:
        >>> idx = SplitIndex(["a.jpg", "b.jpg"], np.zeros((2, 2), np.int32),
        ...                  [np.array([[0, 1, 1, 5, 5], [2, 2, 2, 6, 6]], np.float32),
        ...                   np.array([[1, 0, 0, 4, 4]], np.float32)], ["cat", "dog", "owl"])
        >>> kept, notes = select(idx, classes=[0, 2])
        >>> [len(x) for x in kept.labels], notes
        ([2, 0], ['classes 0, 2 (cat, owl): 1 of 3 labels of other classes dropped'])
    """
    notes: list[str] = []
    n = len(index)
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if fraction < 1 and n:
        keep = max(1, round(fraction * n))
        chosen = np.sort(np.random.default_rng(seed).permutation(n)[:keep])
        index = replace(index, paths=[index.paths[i] for i in chosen], shapes=index.shapes[chosen],
                        labels=[index.labels[i] for i in chosen],
                        image_ids=[index.image_ids[i] for i in chosen] if index.image_ids else index.image_ids,
                        items=index.items[chosen] if index.items is not None else None,
                        segments=None if index.segments is None else index.segments.take(
                            [np.arange(index.segments.starts[i], index.segments.starts[i + 1]) for i in chosen]))
        notes.append(f"fraction {fraction:g}: {keep} of {n} images (seed {seed})")
    if classes is not None:
        wanted = sorted({int(c) for c in classes})
        unknown = [c for c in wanted if not 0 <= c < len(index.names)]
        if unknown or not wanted:
            raise ValueError(f"classes {list(classes)}: the data has classes 0..{len(index.names) - 1} "
                             f"({', '.join(index.names[:5])}{', ...' if len(index.names) > 5 else ''})")
        total = sum(len(x) for x in index.labels)
        kept_rows = [np.isin(x[:, 0].astype(np.int64), wanted) for x in index.labels]
        labels = [x[k] for x, k in zip(index.labels, kept_rows, strict=True)]
        dropped = total - sum(len(x) for x in labels)
        segments = None if index.segments is None else index.segments.take(
            [index.segments.starts[i] + np.flatnonzero(k) for i, k in enumerate(kept_rows)])
        index = replace(index, labels=labels, segments=segments)
        named = ", ".join(index.names[c] for c in wanted)
        notes.append(f"classes {', '.join(map(str, wanted))} ({named}): {dropped} of {total} labels of other "
                     f"classes dropped")
    if single_cls:
        labels = [np.concatenate([np.zeros_like(x[:, :1]), x[:, 1:]], 1) for x in index.labels]
        notes.append(f"single_cls: {len(index.names)} classes trained as one, '{SINGLE_CLASS_NAME}'")
        index = replace(index, labels=labels, names=[SINGLE_CLASS_NAME], category_ids=None)
    return index, notes
