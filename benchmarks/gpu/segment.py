"""Instance segmentation's training step on the GPU: yolov8s-seg against yolov8s (the same step, the mask term
and the prototypes added), and the seg step's peak memory."""

from __future__ import annotations

import torch

from gpu.common import Clock, Row, Settings, TrainStep, attempt, images_per_second

NAME, BASE, BATCH, PRECISION = "yolov8s-seg", "yolov8s", 64, "bf16"


def seg_step(s: Settings, clock: Clock) -> list[Row]:
    """yolov8s-seg and yolov8s at 640, batch 64, bf16, 8 boxes an image with their masks (one index map per image
    at a quarter of the size): images/s of each, timed in turns, their ratio, and the seg step's peak memory."""
    batch = s.batch(BATCH)
    if clock.over():
        return [clock.skipped(f"{NAME} {PRECISION} img/s")]
    rates, note = attempt(lambda: images_per_second(
        s, [TrainStep(s, BASE, batch, PRECISION), TrainStep(s, NAME, batch, PRECISION)], batch))
    base, seg = (rates or (None, None))
    print(f"  {BASE} / {NAME} batch {batch} {PRECISION}: {note or f'{base:.1f} / {seg:.1f} img/s'}", flush=True)
    peak, peak_note = None, "the CPU smoke run measures no device memory"
    if s.cuda and not clock.over():
        def measured() -> float:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            step = TrainStep(s, NAME, batch, PRECISION)
            step()
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() / 2**30

        peak, peak_note = attempt(measured)
    return [Row("seg", f"{NAME} {PRECISION} img/s", seg, "img/s", note=note, data={"batch": batch}),
            Row("seg", f"{NAME} / {BASE} img/s", seg / base if seg and base else None, "x",
                note=note or f"{BASE} {base:.1f} img/s"),
            Row("seg", f"{NAME} {PRECISION} peak memory", peak, "GiB", note=peak_note)]
