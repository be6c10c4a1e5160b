"""What a run says when something outside the epoch loop stops it or costs it data.

- :class:`BatchTrail`: the last two batches' files and whether the run trains or validates, kept so
  that a failed device (a CUDA error) is reported with where it happened and which images it read.
- :func:`store_stopped`: the one line a run ends with when the object store stops answering.
- :func:`diverged_where`: where the losses diverged and which checkpoint is still good.
- :func:`lost_images`: the images of shards found unreadable so far, by any process, for the results row.
"""

from __future__ import annotations

import logging
import sys
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from yolokit.accel import distributed
from yolokit.accel.devices import DeviceFailure
from yolokit.data.sources.images import batch_files
from yolokit.data.store.remote import StoreError, one_line

logger = logging.getLogger("yolokit.train")


class BatchTrail:
    """The last two loader batches as (epoch, batch, step, paths, aug_files), and the phase (training or
    validating). Only the lists the batches hold already are kept, not the batches: their buffers go back
    to the workers."""

    def __init__(self) -> None:
        self.recent: deque[tuple[int, int, int, list, list | None]] = deque(maxlen=2)
        self.phase = "training"

    def add(self, epoch: int, index: int, steps: int, batch: dict[str, Any]) -> None:
        self.recent.append((epoch, index, steps, batch.get("paths", []), batch.get("aug_files")))

    @contextmanager
    def validating(self) -> Iterator[None]:
        self.phase = "validating"
        try:
            yield
        finally:
            self.phase = "training"

    def describe(self, exc: BaseException, batches: int, run_dir: Path) -> str:
        """The message of a run the device stopped: the error, where (epoch, step, batch or validation),
        the last two batches' files, how to find the failing kernel, and the checkpoint to resume from."""
        what = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        lines = [f"the device failed ({type(exc).__name__}: {what})"]
        if self.recent:
            epoch, i, steps, paths, sources = self.recent[-1]
            where = (f"while validating after epoch {epoch + 1}" if self.phase == "validating" else
                     f"in epoch {epoch + 1}, step {steps + 1}, at batch {i + 1} of {batches}")
            lines[0] += f" {where}"
            lines.append(f"the batch's images: {', '.join(batch_files(paths, sources))}")
            if len(self.recent) > 1:
                before = self.recent[0]
                lines.append(f"the batch before (epoch {before[0] + 1}, batch {before[1] + 1}): "
                             f"{', '.join(batch_files(*before[3:]))}")
        lines.append("CUDA reports a failed kernel at a later call, so it may belong to the batch before: run "
                     "again with CUDA_LAUNCH_BLOCKING=1 to stop at the kernel itself (and YOLOKIT_CHECK_INDICES=1 "
                     "to check the device augmentation's gather indices)")
        last = run_dir / "weights" / "last.pt"
        if last.exists():
            lines.append(f"the last checkpoint is {last}: resume with yolokit train --resume {run_dir}")
        return "\n  ".join(lines)

    def device_failure(self, exc: BaseException, batches: int, run_dir: Path) -> DeviceFailure:
        """The :class:`DeviceFailure` to raise, logged now: freeing CUDA memory after such an error while
        the stack unwinds can abort the process before anything else is printed."""
        failure = DeviceFailure(self.describe(exc, batches, run_dir))
        logger.error("%s", failure)
        sys.stderr.flush()
        failure.reported = True
        return failure


def store_stopped(exc: BaseException, run_dir: Path, step: int | None) -> StoreError:
    """The one-line error of a run whose object store stopped: what the store said, what ``last.pt`` holds
    (``step``: the step it was just saved at; None: the last finished epoch) and how to resume."""
    last = run_dir / "weights" / "last.pt"
    if not last.exists():
        return StoreError(f"the data stopped: {one_line(exc)}")
    then = f"{last} holds step {step}" if step is not None else f"{last} holds the last finished epoch"
    return StoreError(f"the data stopped: {one_line(exc)}; {then}: when the store is back, resume with "
                      f"`yolokit train --resume {run_dir}`")


def diverged_where(run_dir: Path, epoch: int) -> dict[str, str]:
    """The watchdog's ``where`` and ``advice`` when the losses diverge in ``epoch``."""
    return dict(where=f" in epoch {epoch + 1}",
                advice=f"The last good checkpoint is {run_dir / 'weights' / 'last.pt'}; try a lower lr0 or "
                       "precision=fp32")


def lost_images(datasets: Sequence[Any]) -> dict[str, int]:
    """Data from shards: ``{"lost_images": n}``, the images of the shards any process found unreadable so
    far (each is named in the log once); nothing for data from files. A collective where there are shards."""
    stores = [d.index.store for d in datasets if getattr(getattr(d, "index", None), "store", None) is not None]
    if not stores:
        return {}
    seen = distributed.all_gather_object([s.lost_chunks() for s in stores])
    return {"lost_images": sum(int(s.sizes[sorted({c for rank in seen for c in rank[k]})].sum())
                               for k, s in enumerate(stores))}
