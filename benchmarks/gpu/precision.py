"""Mixed precision against fp32, and channels_last on against off (the numbers that set its CUDA default)."""

from __future__ import annotations

import torch

from gpu.common import Clock, Row, Settings, TrainStep, attempt, default_channels_last, images_per_second, tf32

# issue 42, in the library's layout (channels_last on CUDA): bf16 and fp16 train yolov8s at >= 1.8x the images/s
# of fp32 with TF32 convolutions (TF32 runs on tensor cores at half bf16's rate: 2x is the compute limit) and at
# >= 3x fp32 with TF32 off. (Issue 16's 2.6x over TF32 fp32 was above that limit.)
SPEEDUP, SPEEDUP_NO_TF32 = 1.8, 3.0


def mixed_precision(s: Settings, clock: Clock) -> list[Row]:
    """yolov8s at 640, batch 64, the library's layout: fp32 with TF32 off, fp32 as PyTorch
    defaults (TF32 convolutions, IEEE matmuls), bf16, fp16; bf16's and fp16's speed-ups over both fp32s."""
    name, batch = "yolov8s", s.batch(64)
    configs = (("fp32, TF32 off", "fp32", False), ("fp32 (TF32 conv)", "fp32", None),
               ("bf16", "bf16", None), ("fp16", "fp16", None))
    rates: dict[str, float | None] = {}
    notes: dict[str, str] = {}
    for label, precision, allow_tf32 in configs:
        if clock.over():
            rates[label], notes[label] = None, "skipped: cap"
            continue
        with tf32(allow_tf32):
            rate, notes[label] = attempt(
                lambda precision=precision: images_per_second(s, [TrainStep(s, name, batch, precision)], batch)[0])
        rates[label] = rate
        print(f"  {name} batch {batch} {label:<18} {'-' if rate is None else f'{rate:8.1f}'} img/s {notes[label]}",
              flush=True)
    rows = [Row("precision", f"{name} {label} img/s", rates[label], "img/s", note=notes[label])
            for label in ("fp32, TF32 off", "fp32 (TF32 conv)")]
    for label in ("bf16", "fp16"):
        rate = rates[label]
        for base, target in (("fp32 (TF32 conv)", SPEEDUP), ("fp32, TF32 off", SPEEDUP_NO_TF32)):
            speedup = rate / rates[base] if rate and rates[base] else None
            rows.append(Row("precision", f"{name} {label} / {base} img/s", speedup, "x", (">=", target),
                            note=f"{rate:.1f} img/s" if rate else notes[label], data={"images_per_s": rate}))
    return rows


# The channels_last section's rows, most telling first (the cap cuts the rest): training in bf16 over the
# families (yolov8s, yolov8l, yolov3, a model YAML, yolov8n), then fp16, then inference. The default it
# checks was set from an H200's rows (BENCHMARKS.md "GPU"); the next pass confirms it on its GPU.
CHANNELS_LAST_ROWS = (
    ("yolov8s", 64, "train", "bf16"), ("yolov8l", 32, "train", "bf16"), ("yolov3", 32, "train", "bf16"),
    ("yolo11s.yaml", 64, "train", "bf16"), ("yolov8n", 64, "train", "bf16"),
    ("yolov8s", 64, "train", "fp16"), ("yolov8l", 32, "train", "fp16"),
    ("yolov8s", 64, "infer", "bf16"), ("yolov8l", 32, "infer", "bf16"), ("yolov8n", 64, "infer", "bf16"),
)


def channels_last(s: Settings, clock: Clock) -> list[Row]:
    """Training (bf16, fp16) and inference (bf16, fused, eval) images/s with channels_last on
    and off, each pair timed in turns (``CHANNELS_LAST_ROWS``, in order, while the cap lasts); the
    speed-up on / off per row, and what it says for the default (``models.prefers_channels_last``)."""
    rows, wins, total = [], 0, 0
    smoke = [("yolov8n", 64, kind, precision) for kind, precision in (("train", "bf16"), ("train", "fp16"),
                                                                       ("infer", "bf16"))]   # each path, smallest
    for name, batch, kind, precision in smoke if s.smoke else CHANNELS_LAST_ROWS:
        batch = s.batch(batch)
        what = f"{name} {kind} {precision}: channels_last on / off img/s"
        if clock.over():
            rows.append(clock.skipped(what))
            continue
        make = TrainStep if kind == "train" else InferStep
        rates, note = attempt(lambda make=make, name=name, batch=batch, precision=precision: images_per_second(
            s, [make(s, name, batch, precision, channels_last=False),
                make(s, name, batch, precision, channels_last=True)], batch))
        speedup = rates[1] / rates[0] if rates else None
        if speedup is not None:
            wins, total = wins + (speedup > 1), total + 1
            note = f"off {rates[0]:.1f}, on {rates[1]:.1f} img/s"
        print(f"  {name} batch {batch} {kind} {precision}: {note}"
              f"{'' if speedup is None else f'  on / off {speedup:.2f}x'}", flush=True)
        rows.append(Row("channels_last", what, speedup, "x", note=note,
                        data={"images_per_s_off": rates and rates[0], "images_per_s_on": rates and rates[1]}))
    rows.append(Row("channels_last", f"faster with channels_last on (of {total})", float(wins),
                    note=f"default on {s.device.type} now: {'on' if default_channels_last(s) else 'off'} "
                         f"(models.prefers_channels_last)"))
    return rows


class InferStep:
    """One inference forward of a fused model in eval mode under autocast (what ``predict`` runs per batch)."""

    def __init__(self, s: Settings, name: str, batch: int, precision: str, *, channels_last: bool) -> None:
        from harness import inputs

        import yolokit
        from yolokit.accel import Precision

        self.model = yolokit.create_model(name).to(s.device).eval().fuse(channels_last=channels_last)
        self.amp = Precision(precision, s.device)
        images = inputs.random_images(batch, s.imgsz).to(s.device)
        self.images = images.contiguous(memory_format=torch.channels_last) if channels_last else images

    def __call__(self) -> None:
        with torch.inference_mode(), self.amp.autocast():
            self.model(self.images)

