"""``benchmark(weights)``: every format side by side: size, export time, mAP50-95 and speed.

For each format the model is exported (and checked, ``deploy.exporter``), loaded back and then

- validated on the run's validation split (``yolokit.val.validate``: the protocol of ``yolokit val``,
  rectangular batches where the file takes any size; an end-to-end model's rows, eager included, score
  its one-to-one branch without NMS, the output its files hold);
- timed at batch 1 (latency, the median of ``repeats`` forward passes after ``warmup``) and at batch
  16 (images per second), at ``imgsz`` on random input: the file's forward pass only, as a server
  would call it after decoding and letterboxing.

Rows "eager" (the Detector as loaded) and "eager fused" (batch norms folded, ``Detector.fuse``) come
first. A format whose runtime is not installed is a row that says so.
"""

from __future__ import annotations

import copy
import importlib.util
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from yolokit.deploy.exporter import FORMATS, export
from yolokit.deploy.runtime import EXTRAS, ExportedModel
from yolokit.models import Detector

ROWS = ("eager", "eager fused", "onnx", "onnx fp16", "openvino", "openvino fp16", "openvino int8", "pt2")


@dataclass
class Row:
    """One format's figures (None where it did not run; ``note`` says why)."""

    format: str
    size_mb: float | None = None
    export_s: float | None = None
    map50_95: float | None = None
    latency_ms: float | None = None
    images_per_s: float | None = None
    note: str = ""


def _timed(run: Any, batch: torch.Tensor, warmup: int, repeats: int) -> float:
    """The median seconds of ``run(batch)`` over ``repeats`` calls after ``warmup``."""
    with torch.inference_mode():
        for _ in range(warmup):
            run(batch)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            run(batch)
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def _map(model: Any, data: str, imgsz: int, batch: int) -> float:
    from yolokit.data import DetectionDataset, build_dataloader
    from yolokit.val import validate

    fixed = getattr(model, "fixed_imgsz", None)
    dataset = DetectionDataset(data, "val", imgsz=imgsz, rect=fixed is None, stride=int(max(model.strides)))
    loader = build_dataloader(dataset, batch, workers=0, shuffle=False)
    # an end-to-end model (YOLO26) is exported with its one-to-one output: every row scores that branch
    result, _ = validate(model, loader, num_classes=model.num_classes, nms=not model.end_to_end)
    return float(result.map50_95)


def _size_mb(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files) / 2**20


def benchmark(model: Detector, *, data: str = "shapes", imgsz: int = 640, formats: Sequence[str] = ROWS,
              out: str | Path | None = None, batch: int = 16, warmup: int = 3, repeats: int = 10,
              val_imgsz: int | None = None, report: Any = print) -> list[Row]:
    """Exports ``model`` to each of ``formats`` (``ROWS``) and measures each file.

    Args:
        model: the trained Detector (``yolokit.load("best.pt")``).
        data: what it is validated on (its ``val`` split): a data.yaml, a COCO json or "shapes".
        imgsz: the size the speed is measured at (every file takes any size: the export is at ``val_imgsz``).
        formats: the rows to measure.
        out: where the files go (default: a temporary folder, removed at the end).
        batch: the batch of the throughput figure (and of validation).
        warmup, repeats: forward passes before timing, and timed (the median is kept).
        val_imgsz: the validation size (default ``imgsz``), also the export's: int8 is calibrated at it.
        report: called with each row's line as it is measured; None: quiet.

    Returns:
        One :class:`Row` per format, in order. ``format_table(rows)`` prints them.

    Examples:
        >>> rows = benchmark(yolokit.load("runs/train/weights/best.pt"), data="shapes", imgsz=320)
        >>> print(format_table(rows))
    """
    unknown = [f for f in formats if f not in ROWS]
    if unknown:
        raise ValueError(f"unknown benchmark formats {unknown}; choose from {', '.join(ROWS)}")
    model = copy.deepcopy(model).float().cpu().eval()   # the caller's model stays on its device
    folder = tempfile.TemporaryDirectory(prefix="yolokit-benchmark-") if out is None else None
    where = Path(folder.name if folder else out)
    where.mkdir(parents=True, exist_ok=True)
    rows = []
    speed = torch.rand(batch, 3, imgsz, imgsz, generator=torch.Generator().manual_seed(0))
    try:
        for name in formats:
            row = Row(name)
            rows.append(row)
            fmt, _, precision = name.partition(" ")
            if fmt == "eager":
                runner: Any = copy.deepcopy(model).fuse(channels_last=False) if precision == "fused" else model

                def run(images: torch.Tensor, net: Detector = runner) -> torch.Tensor:   # as a file's output
                    return net.decode(net(images))
            else:
                module = EXTRAS[fmt][0]
                if importlib.util.find_spec(module) is None or (precision == "int8" and
                                                                importlib.util.find_spec("nncf") is None):
                    row.note = f"not installed: pip install 'yolokit[{EXTRAS[fmt][1]}]'"
                    continue
                path = where / f"{model.name}-{name.replace(' ', '-')}{FORMATS[fmt]}"
                started = time.perf_counter()
                try:
                    export(model, fmt, path, imgsz=val_imgsz or imgsz, half=precision == "fp16",
                           int8=precision == "int8", data=data if precision == "int8" else None, report=None)
                except Exception as exc:   # one row fails, the table goes on
                    row.note = f"export failed: {str(exc).splitlines()[0][:120]}"
                    continue
                row.export_s = time.perf_counter() - started
                row.size_mb = _size_mb(path)
                runner = ExportedModel(path)
                run = runner
            row.map50_95 = _map(runner, data, val_imgsz or imgsz, batch)
            row.latency_ms = 1000 * _timed(run, speed[:1], warmup, repeats)
            row.images_per_s = batch / _timed(run, speed, max(1, warmup // 2), max(3, repeats // 3))
            if report is not None:
                report(format_row(row))
    finally:
        if folder is not None:
            folder.cleanup()
    return rows


HEADER = f"{'format':<15}{'size MB':>9}{'export s':>10}{'mAP50-95':>10}{'batch 1 ms':>12}{'batch N img/s':>15}"


def format_row(row: Row) -> str:
    def cell(value: float | None, width: int, digits: int) -> str:
        return f"{'-' if value is None else f'{value:.{digits}f}':>{width}}"

    return (f"{row.format:<15}{cell(row.size_mb, 9, 1)}{cell(row.export_s, 10, 1)}{cell(row.map50_95, 10, 3)}"
            f"{cell(row.latency_ms, 12, 1)}{cell(row.images_per_s, 15, 1)}" + (f"  {row.note}" if row.note else ""))


def format_table(rows: Sequence[Row]) -> str:
    """The rows as a fixed-width table."""
    return "\n".join([HEADER, *(format_row(r) for r in rows)])
