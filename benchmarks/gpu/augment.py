"""The augmentation on the device (``augment_on="device"``): the batched pass and the JPEG decode alone.

The shapes set at 640 with the default augmentation (Mosaic, HSV, flips) and MixUp at 0.5 so
both views are warped: the loader's main process makes a batch of 64 recipes (JPEG bytes and
numbers; `yolokit.data.augment.recipes`), then `device_augment.augment_batch` (nvJPEG decode, resize,
Mosaic + warp, MixUp, HSV, flips) and `decode_sources` alone are timed on the device from that
batch, in turns. Also the device memory one pass takes at its peak, and what the loader's
side costs per image on the CPU, recipes against the workers' OpenCV images.
"""

from __future__ import annotations

import time

import torch
from harness.timing import synchronize

from gpu.common import Clock, Row, Settings, images_per_second, shapes_yaml


def _loader(s: Settings, augment_on: str, batch: int):
    from yolokit.data import AugmentConfig, DetectionDataset, build_dataloader

    dataset = DetectionDataset(shapes_yaml(s), "train", imgsz=s.imgsz, augment=True, hyp=AugmentConfig(mixup=0.5))
    return build_dataloader(dataset, batch, workers=0, seed=0, uint8_images=True, pin_memory=s.cuda,
                            augment_on=augment_on)


def _loader_seconds_per_image(s: Settings, augment_on: str, batch: int) -> float:
    """The main process's seconds per image of the second batch (the first fills the recent-image buffer)."""
    batches = iter(_loader(s, augment_on, batch))
    next(batches)
    start = time.perf_counter()
    got = next(batches)
    return (time.perf_counter() - start) / len(got["indices"])


PROFILE_FILE = "augment-profile.txt"   # in the results' folder: the pass's kernels by total time (issue 42)
PROFILE_ROWS = 25


def _profile(s: Settings, run, n: int, passes: int = 3, file: str = PROFILE_FILE, what: str = "device pass") -> str:
    """``torch.profiler``'s table of the pass's kernels by their total time over ``passes`` passes (CUDA
    kernels on a GPU, CPU ops in the smoke run), written to ``file`` in ``s.out``; returns the row's note."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s.cuda else [])
    run()
    synchronize(s.device)
    with profile(activities=activities) as prof:
        for _ in range(passes):
            run()
        synchronize(s.device)
    key = "cuda_time_total" if s.cuda else "cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=PROFILE_ROWS)
    kernels = sum(e.count for e in prof.key_averages() if (e.device_type.name == "CUDA") == s.cuda)
    text = (f"{what}, batch {n} at {s.imgsz} px, {passes} passes, sorted by {key} "
            f"({kernels / passes:.0f} {'kernels' if s.cuda else 'ops'} a pass)\n{table}")
    if s.out is None:
        return f"{kernels / passes:.0f} a pass; no folder to write the table to"
    s.out.mkdir(parents=True, exist_ok=True)
    (s.out / file).write_text(text)
    return f"{kernels / passes:.0f} {'kernels' if s.cuda else 'ops'} a pass; table in {file}"


def _peak_mib_per_image(s: Settings, run, n: int) -> float | None:
    """The device memory one pass takes at its peak over what was held before, MiB per image (CUDA)."""
    if not s.cuda:
        return None
    synchronize(s.device)
    torch.cuda.reset_peak_memory_stats(s.device)
    before = torch.cuda.memory_allocated(s.device)
    run()
    synchronize(s.device)
    return (torch.cuda.max_memory_allocated(s.device) - before) / 2**20 / n


def device_pass(s: Settings, clock: Clock) -> list[Row]:
    from yolokit.data.augment.device_augment import augment_batch, decode_sources

    n = s.batch(64)
    batch = next(iter(_loader(s, "device", n)))
    whole = lambda: augment_batch(batch, s.device)           # noqa: E731
    decode = lambda: decode_sources(batch, s.device)          # noqa: E731
    pass_ips, decode_ips = images_per_second(s, [whole, decode], n)
    peak = _peak_mib_per_image(s, whole, n)
    profile_note = _profile(s, whole, n)
    mixed = int((batch["aug_mix"] < 1).sum())
    rows = [Row("augment", f"device pass img/s (decode..HSV, batch {n}, {mixed} MixUp)", pass_ips, "img/s",
                data={"images_per_s": pass_ips, "mixup_images": mixed, "imgsz": s.imgsz}),
            Row("augment", f"JPEG decode alone img/s (batch {n}, {len(batch['aug_jpeg']) / 2**20:.1f} MiB)",
                decode_ips, "img/s", data={"images_per_s": decode_ips}),
            Row("augment", "device pass peak memory per image", peak, "MiB",
                note="n/a on the CPU" if peak is None else "", data={"mib_per_image": peak}),
            Row("augment", "device pass: its top kernels", None, note=profile_note)]
    if clock.over():
        return rows + [clock.skipped("loader CPU seconds per image: OpenCV images / recipes")]
    workers = _loader_seconds_per_image(s, "workers", n)
    device = _loader_seconds_per_image(s, "device", n)
    print(f"  loader main process: {1e3 * workers:.1f} ms per image making images, {1e3 * device:.2f} ms "
          f"making recipes; device pass {pass_ips:.0f} img/s, decode {decode_ips:.0f} img/s", flush=True)
    return rows + [Row("augment", "loader CPU seconds per image: OpenCV images / recipes", workers / device, "x",
                       data={"workers_ms": 1e3 * workers, "recipes_ms": 1e3 * device})]


FUSED_PROFILE_FILE = "fused-profile.txt"


def fused_pass(s: Settings, clock: Clock) -> list[Row]:
    """The pass and the HSV step through ``torch.compile`` (``compiled=True``, `yolokit.data.augment.fused`) against
    eager, on the augment section's batch: the compile's seconds, the images equal, images/s of both in
    turns, the peak memory per image, the HSV step at batch 64, and the compiled pass's kernels. The smoke
    run compiles nothing (its "compiled" rows time the eager pass: the code paths only)."""
    from harness.pipeline import hsv_step_seconds

    from yolokit.data.augment.device_augment import augment_batch

    n = s.batch(64)
    batch = next(iter(_loader(s, "device", n)))
    eager = lambda: augment_batch(batch, s.device)                          # noqa: E731
    compile_it = not s.smoke
    fused = lambda: augment_batch(batch, s.device, compiled=compile_it)     # noqa: E731
    start = time.perf_counter()
    images = fused()
    synchronize(s.device)
    compile_s = time.perf_counter() - start
    same = bool(torch.equal(images, eager()))
    rows = [Row("fused", "compile: the pass's four stages, first call", compile_s, "s",
                note="paid once a process, on the trainer's first batch"),
            Row("fused", "compiled pass == eager pass, bit for bit", float(same), "", target=("==", 1.0),
                note="" if same else "DIFFERENT: keep compile_augment off", data={"equal": same})]
    eager_ips, fused_ips = images_per_second(s, [eager, fused], n)
    peak = _peak_mib_per_image(s, fused, n)
    print(f"  device pass batch {n}: eager {eager_ips:.0f} img/s, compiled {fused_ips:.0f} img/s (compile "
          f"{compile_s:.0f} s), peak {'-' if peak is None else f'{peak:.1f}'} MiB per image", flush=True)
    rows += [Row("fused", f"device pass img/s, compiled (batch {n})", fused_ips, "img/s", target=(">=", 8000.0),
                 note=f"eager {eager_ips:.0f} img/s in turns", data={"eager": eager_ips, "compiled": fused_ips}),
             Row("fused", "compiled pass peak memory per image", peak, "MiB", target=("<=", 15.0),
                 note="n/a on the CPU" if peak is None else "")]
    if clock.over():
        return rows + [clock.skipped("HSV step at batch 64, compiled / eager")]
    hsv = [hsv_step_seconds(n, s.imgsz, s.device, compiled=c) * 1e3 for c in (False, compile_it)]
    rows.append(Row("fused", f"HSV step, batch {n}, compiled", hsv[1], "ms", target=("<=", 1.0),
                    note=f"eager {hsv[0]:.2f} ms", data={"eager_ms": hsv[0], "compiled_ms": hsv[1]}))
    if clock.over():
        return rows + [clock.skipped("compiled pass: its top kernels")]
    note = _profile(s, fused, n, file=FUSED_PROFILE_FILE, what="compiled device pass")
    return rows + [Row("fused", "compiled pass: its top kernels", None, note=note)]
