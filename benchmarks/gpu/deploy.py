"""The exported ``.pt2`` on CUDA (issue 52's GPU row): AOTInductor's package against the eager model.

yolov8n at 640 (64 in the smoke run), fused, float32 and float16: the eager Detector (network and
decode) and ``yolokit.export(model, "pt2", device="cuda")``'s package, each timed at batch 1 (the
median latency) and at batch 16 (images/s), in turns; the export's seconds (the compile) and its
check line; then float32 with NMS in the graph (``nms=True``: torchvision's nms kernel in the package),
its export and images/s at batch 16. The CPU rows of every format are ``yolokit benchmark``'s
(BENCHMARKS.md "Export").
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from pathlib import Path

import torch
from harness.timing import synchronize

from gpu.common import Clock, Row, Settings, attempt


def _median_s(s: Settings, run, batch: torch.Tensor, rounds: int) -> float:
    times = []
    with torch.inference_mode():
        for _ in range(3):
            run(batch)
        synchronize(s.device)
        for _ in range(rounds):
            start = time.perf_counter()
            run(batch)
            synchronize(s.device)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def pt2_cuda(s: Settings, clock: Clock) -> list[Row]:
    """Rows: per precision, the export seconds, eager and .pt2 latency at batch 1 (ms) and images/s at 16."""
    import yolokit
    from yolokit.deploy import ExportedModel

    device = "cuda" if s.cuda else "cpu"
    imgsz, rounds = (s.imgsz, 20) if s.cuda else (64, 2)
    rows = []
    for half in (False, True):
        label = "fp16" if half else "fp32"
        if clock.over():
            rows.append(clock.skipped(f"yolov8n {label} .pt2 export"))
            continue
        torch.manual_seed(0)
        model = yolokit.create_model("yolov8n").eval().fuse(channels_last=False)
        eager = copy.deepcopy(model).to(s.device, torch.float16 if half else torch.float32)
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "yolov8n.pt2"
            said = []
            start = time.perf_counter()
            _, note = attempt(lambda model=model, path=path, half=half, said=said: yolokit.export(
                model, "pt2", path, imgsz=imgsz, half=half, device=device, report=said.append))
            seconds = time.perf_counter() - start
            rows.append(Row("deploy", f"yolov8n {label} .pt2 export (AOTInductor compile) s", seconds, "s",
                            note=note or (said[0].split("; ")[-1][:120] if said else "")))
            if note:
                continue
            package = ExportedModel(path, device=device)
            for n in (1, 16):
                x = torch.rand(s.batch(n) if n > 1 else 1, 3, imgsz, imgsz, device=s.device)
                dtype = next(eager.parameters()).dtype
                runs = {"eager": lambda b, dtype=dtype, eager=eager: eager.decode(eager(b.to(dtype))),
                        ".pt2": package}
                for name, run in runs.items():
                    value = _median_s(s, run, x, rounds)
                    figure = (1000 * value, "ms") if n == 1 else (len(x) / value, "img/s")
                    what = f"yolov8n {label} {name} " + ("batch 1 latency ms" if n == 1 else "batch 16 img/s")
                    print(f"  {what}: {figure[0]:.2f}", flush=True)
                    rows.append(Row("deploy", what, figure[0], figure[1]))
    if not clock.over():           # NMS in the graph: torchvision's nms kernel inside the CUDA package
        torch.manual_seed(0)
        model = yolokit.create_model("yolov8n").eval().fuse(channels_last=False)
        with tempfile.TemporaryDirectory() as folder:
            path, said = Path(folder) / "yolov8n-nms.pt2", []
            start = time.perf_counter()
            _, note = attempt(lambda: yolokit.export(model, "pt2", path, imgsz=imgsz, nms=True, device=device,
                                                     report=said.append))
            rows.append(Row("deploy", "yolov8n fp32 .pt2 with NMS export s", time.perf_counter() - start, "s",
                            note=note or (said[0].split("; ")[-1][:120] if said else "")))
            if not note:
                x = torch.rand(s.batch(16), 3, imgsz, imgsz, device=s.device)
                value = _median_s(s, ExportedModel(path, device=device), x, rounds)
                rows.append(Row("deploy", "yolov8n fp32 .pt2 with NMS batch 16 img/s", len(x) / value, "img/s"))
    return rows
