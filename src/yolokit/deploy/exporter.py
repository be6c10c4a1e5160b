"""``export(model, format=...)``: one call for every format, and a check of the file before it is called exported.

Formats (``FORMATS``):

- ``onnx``: ``interop.onnx.export_onnx``; float32 or float16 (``half``), NMS optional; run by onnxruntime.
- ``openvino``: the ONNX graph converted by OpenVINO into a folder (``<name>_openvino/``: ``.xml``,
  ``.bin`` and ``yolokit.json``); ``half`` stores the weights as float16; ``int8`` quantizes it after
  training with NNCF, calibrated on images of a dataset (``data``).
- ``pt2``: ``torch.export`` compiled by AOTInductor into a ``.pt2`` package for the CPU or for CUDA
  (``device``); it needs nothing but torch where it runs.

Every format takes a dynamic batch and, unless ``dynamic=False``, any height and width that are
multiples of the largest stride; each keeps the choice between the decoded predictions
[B, P, 4 + C] and NMS in the graph (``nms``), and YOLO26 keeps its
end-to-end output without NMS.

The check: the file runs once on a sample batch (two images at the export size, and one of another
size when the size is dynamic) and its output is compared with the eager model's. The largest
difference is printed; past the format's tolerance (``TOLERANCES``) the export fails with
:class:`ExportError` naming the format, and the file is removed. Boxes are compared relative to the input's longer side,
scores as they are (in [0, 1]):

- float32: 1e-4 (0.064 px at 640);
- float16: 2e-2; int8: boxes 5e-2, scores 0.1. These only catch a broken graph:
  their accuracy is judged by mAP (``yolokit val --weights <file>``, ``yolokit benchmark``).

A segmentation model's masks are compared too (``mask_iou``: the IoU of the model's and the file's masks of
the same points, at least ``MASK_IOU``: 0.99 in float32, 0.95 in float16, 0.8 in int8).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from yolokit.deploy.runtime import ExportedModel, ExportError, require
from yolokit.interop.onnx import export_graph, export_onnx, export_shapes, file_info
from yolokit.models import Detector
from yolokit.ops.masks import decode_masks
from yolokit.ops.nms import detection_rows

FORMATS = {"onnx": ".onnx", "openvino": "_openvino", "pt2": ".pt2"}
"""Each format and how its default output is named: ``<model name><suffix>`` (OpenVINO: a folder)."""
TOLERANCES = {"fp32": (1e-4, 1e-4), "fp16": (2e-2, 2e-2), "int8": (5e-2, 0.1)}
"""The check's largest allowed difference per precision: (boxes relative to the input's longer side, scores)."""


def export(
    model: Detector,
    format: str = "onnx",
    out: str | Path | None = None,
    *,
    imgsz: int | tuple[int, int] = 640,
    half: bool = False,
    int8: bool = False,
    data: str | None = None,
    dynamic: bool = True,
    nms: bool = False,
    end_to_end: bool | None = None,
    conf: float = 0.25,
    iou: float = 0.7,
    max_det: int = 300,
    device: str = "cpu",
    check: bool = True,
    report: Callable[[str], Any] | None = print,
) -> Path:
    """Writes ``model`` in ``format``, runs the file once and compares it with the model.

    Args:
        model: any yolokit Detector (left as it is: the export works on a copy).
        format: "onnx", "openvino" or "pt2".
        out: the file (a folder for OpenVINO); default ``<model name><suffix>`` (``FORMATS``). A file
            name without its format's suffix gets it (``--out model_pt2`` writes ``model_pt2.pt2``).
        imgsz: the export size, one int or (height, width), multiples of the largest stride.
        half: float16 (OpenVINO: float16 weights).
        int8: OpenVINO only: post-training quantization with NNCF, calibrated on ``data``.
        data: what ``int8`` calibrates on: a data.yaml, a COCO json or "shapes" (its train split).
        dynamic: any height and width (multiples of the largest stride); False: ``imgsz`` only.
        nms: NMS in the graph; the output becomes ``detections`` [K, 7] (image, box, score, class).
        end_to_end: YOLO26's one-to-one branch and its top-k, no NMS; None: for such a model unless ``nms``.
        conf, iou, max_det: the thresholds of NMS in the graph (``max_det``: also the end-to-end top-k).
        device: "cpu" or "cuda": where a ``.pt2`` runs (and is checked).
        check: run the file and compare it with the model (``TOLERANCES``).
        report: called with each line to show (the check's result); None shows nothing.

    Returns:
        The path written.

    Raises:
        ValueError: a bad argument (the message names it). ImportError: the format's extra is not
        installed. ExportError: the file differs from the model past the tolerance.

    Examples:
        >>> path = yolokit.export(yolokit.create_model("yolov8n"), "onnx", imgsz=320, half=True)
        exported yolov8n to yolov8n.onnx (onnx, fp16, 12.6 s); checked: boxes within 0.012 px, scores within 0.0003
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    precision = "int8" if int8 else "fp16" if half else "fp32"
    if int8 and format != "openvino":
        raise ValueError(f"int8 is the OpenVINO format's (--format openvino --int8), not {format}'s")
    if int8 and half:
        raise ValueError("int8 and half exclude each other")
    if int8 and not data:
        raise ValueError("int8 needs calibration images: data='path/to/data.yaml' (--data)")
    if device not in ("cpu", "cuda") or (device == "cuda" and format != "pt2"):
        raise ValueError(f"device {device!r}: the {format} export is made on the cpu"
                         + ("" if device in ("cpu", "cuda") else "; pt2 also takes cuda"))
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda': no CUDA device here")
    if end_to_end is None:
        end_to_end = model.end_to_end and not nms
    h, w = (imgsz, imgsz) if isinstance(imgsz, int) else tuple(imgsz)
    stride = int(max(model.strides))
    if h % stride or w % stride:
        raise ValueError(f"imgsz {h}x{w} must be a multiple of {model.name}'s largest stride {stride}")
    require(format)
    out = output_path(model.name, format, out)
    out.parent.mkdir(parents=True, exist_ok=True)   # as a run folder is made: a new folder is no error
    options = dict(nms=nms, end_to_end=end_to_end, conf=conf, iou=iou, max_det=max_det, dynamic=dynamic)
    started = time.perf_counter()
    if format == "onnx":
        export_onnx(model, out, imgsz=(h, w), half=half, **options)
    elif format == "openvino":
        from yolokit.deploy.openvino import export_openvino

        export_openvino(model, out, imgsz=(h, w), half=half, int8=int8, data=data, **options)
    else:
        export_pt2(model, out, imgsz=(h, w), half=half, device=device, **options)
    seconds = time.perf_counter() - started
    line = f"exported {model.name} to {out} ({format}, {precision}, {seconds:.1f} s)"
    if check:
        try:
            line += "; checked: " + check_export(model, out, precision=precision, device=device)
        except Exception as exc:       # a file that failed its check, or did not run, is not left to be used
            shutil.rmtree(out) if out.is_dir() else out.unlink(missing_ok=True)
            said = str(exc) if isinstance(exc, ExportError) else \
                f"the {format} file {out} did not run: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
            raise ExportError(f"{said} (the file is removed)") from None
    if report is not None:
        report(line)
    return out


def output_path(name: str, format: str, out: str | Path | None) -> Path:
    """Where ``export`` writes: ``out`` with its format's suffix added when it lacks it (a runtime knows a
    file's format by its suffix), or ``<name><suffix>``; OpenVINO's folder is named as given.

    Examples:
        >>> output_path("yolov8n", "pt2", "model_pt2"), output_path("yolov8n", "onnx", None)
        (PosixPath('model_pt2.pt2'), PosixPath('yolov8n.onnx'))
    """
    suffix = FORMATS[format]
    if out is None:
        return Path(f"{name}{suffix}")
    out = Path(out)
    return out.with_name(out.name + suffix) if suffix.startswith(".") and out.suffix != suffix else out


class WithNMS(torch.nn.Module):
    """``net``'s decoded predictions through ``ops.nms.detection_rows``: the ``detections`` [K, 7] output."""

    def __init__(self, net: torch.nn.Module, *, conf: float, iou: float, max_det: int) -> None:
        super().__init__()
        self.net, self.conf, self.iou, self.max_det = net, conf, iou, max_det

    def forward(self, images: Tensor) -> Tensor:
        return detection_rows(self.net(images).float(), conf=self.conf, iou=self.iou, max_det=self.max_det)


def export_pt2(model: Detector, path: str | Path, *, imgsz: tuple[int, int], half: bool = False, device: str = "cpu",
               nms: bool = False, end_to_end: bool = False, conf: float = 0.25, iou: float = 0.7, max_det: int = 300,
               dynamic: bool = True) -> Path:
    """``torch.export`` of the decoded graph (with ``nms``: and its NMS, ``WithNMS``; torchvision's
    ``nms`` op then runs in the package, so torchvision is needed where it runs), compiled by
    AOTInductor into a ``.pt2`` package for ``device``; the package's metadata holds ``file_info``
    (key ``yolokit``)."""
    h, w = imgsz
    graph = export_graph(model, nms=nms, end_to_end=end_to_end, max_det=max_det, half=half)
    if nms:
        graph = WithNMS(graph, conf=conf, iou=iou, max_det=max_det)
    graph = graph.to(device)
    example, shapes = export_shapes(model, h, w, dynamic=dynamic)
    info = file_info(model, h, w, nms=nms, end_to_end=end_to_end, dynamic=dynamic, half=half, conf=conf,
                     iou=iou, max_det=max_det)
    info["device"] = device
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
        program = torch.export.export(graph, (example.to(device),), dynamic_shapes=shapes)
        written = torch._inductor.aoti_compile_and_package(
            program, package_path=str(path), inductor_configs={"aot_inductor.metadata": {"yolokit": json.dumps(info)}})
    return Path(written)


def sample_batches(model: Detector, h: int, w: int, dynamic: bool) -> list[Tensor]:
    """The check's input: two seeded images at the export size, and one a stride larger when the size
    is dynamic; smooth blobs on noise, so that a trained model finds something in them."""
    generator = torch.Generator().manual_seed(0)
    sizes = [(2, h, w)] + ([(1, h + int(max(model.strides)), w)] if dynamic else [])
    batches = []
    for n, bh, bw in sizes:
        coarse = torch.rand(n, 3, max(bh // 32, 2), max(bw // 32, 2), generator=generator)
        smooth = torch.nn.functional.interpolate(coarse, size=(bh, bw), mode="bilinear", align_corners=False)
        batches.append((0.8 * smooth + 0.2 * torch.rand(n, 3, bh, bw, generator=generator)).clamp(0, 1))
    return batches


def check_export(model: Detector, path: str | Path, *, precision: str = "fp32", device: str = "cpu") -> str:
    """Runs the file at ``path`` on ``sample_batches`` and compares it with ``model``; returns the line
    that says by how much they differ, or raises ExportError past ``TOLERANCES[precision]``."""
    exported = ExportedModel(path, device=device)
    info = exported.info
    h, w = info["imgsz"]
    box_tol, score_tol = TOLERANCES[precision]
    graph = export_graph(model, nms=info["output"] == "detections", end_to_end=info["output"] == "end_to_end",
                         max_det=info["max_det"])
    box, score, counts, worst_mask = 0.0, 0.0, 0, None
    for batch in sample_batches(model, h, w, info["dynamic"]):
        with torch.no_grad():
            eager = graph(batch)
        got = exported(batch)
        if exported.masks:   # a segmentation model's: its masks compared, then its boxes and scores as any model's
            got = tuple(t.float().cpu() for t in got)
            iou = mask_iou(eager, got, tuple(batch.shape[-2:]), rows=info["output"] == "end_to_end")
            if iou is not None:
                worst_mask = iou if worst_mask is None else min(worst_mask, iou)
            eager, got = eager[0], got[0]
        got = got.float().cpu()
        side = max(batch.shape[-2:])
        if info["output"] == "predictions":
            if got.shape != eager.shape:
                raise ExportError(f"{path}: the {exported.format} file gives shape {tuple(got.shape)}, "
                                  f"the model {tuple(eager.shape)}")
            box = max(box, float((got[..., :4] - eager[..., :4]).abs().max()) / side)
            score = max(score, float((got[..., 4:] - eager[..., 4:]).abs().max()))
            continue
        if info["output"] == "detections":
            eager = graph_nms(eager, conf=info["conf"], iou=info["iou"], max_det=info["max_det"])
            got = [got[got[:, 0] == i][:, 1:] for i in range(len(batch))]
        b, s, c = row_difference(list(eager), list(got), score_tol)
        box, score, counts = max(box, b / side), max(score, s), max(counts, c)
    line = (f"boxes within {box * max(h, w):.3g} px ({box:.2g} of the side; tolerance {box_tol:g}), "
            f"scores within {score:.2g} (tolerance {score_tol:g})")
    if counts:
        line += f", {counts} detections more or fewer in an image"
    if exported.masks:
        line += (f", masks IoU {worst_mask:.4f} at least (tolerance {MASK_IOU[precision]:g})" if worst_mask is not None
                 else ", masks: none of 100 pixels to compare on the check images")
    if box > box_tol or score > score_tol or (counts and precision == "fp32") or (
            worst_mask is not None and worst_mask < MASK_IOU[precision]):
        raise ExportError(f"{exported.format} export of {path} differs from the model: {line}")
    return line


MASK_IOU = {"fp32": 0.99, "fp16": 0.95, "int8": 0.8}
"""The check's smallest allowed IoU between a mask of the model and the file's, per precision."""


def mask_iou(eager: tuple[Tensor, ...], got: tuple[Tensor, ...], size: tuple[int, int], *, rows: bool,
             points: int = 20, least: int = 100) -> float | None:
    """The smallest IoU between the model's and the file's masks at the input (``ops.masks.decode_masks``) of the
    same predictions, over the whole input (not cut to a box: an untrained model's boxes may hold no pixel,
    its coefficients and prototypes still differ or not): each image's ``points`` best points and ``points``
    more spread over all of them (an end-to-end file's first rows, where its rows agree with the model's in
    class and box within a pixel), masks of ``least`` pixels or more (their union); None when there is none."""
    (preds, coefficients, protos), (got_preds, got_coefficients, got_protos) = eager, got
    worst = None
    for b in range(len(preds)):
        if rows:
            n = min(points, len(preds[b]), len(got_preds[b]))
            same = (preds[b, :n, 5] == got_preds[b, :n, 5]) & ((preds[b, :n, :4] - got_preds[b, :n, :4]).abs()
                                                                  .amax(-1) < 1)
            index = same.nonzero().flatten()
        else:   # the best points, and points spread over every level (an untrained model's best may have no mask)
            n = preds.shape[1]
            index = torch.cat((preds[b, :, 4:].amax(-1).topk(min(points, n)).indices,
                               torch.linspace(0, n - 1, min(points, n)).long())).unique()
        boxes = preds.new_tensor([[0.0, 0.0, size[1], size[0]]]).expand(len(index), 4)
        a = decode_masks(coefficients[b, index], protos[b], boxes, size)
        g = decode_masks(got_coefficients[b, index], got_protos[b], boxes, size)
        union = (a | g).sum((1, 2))
        if (union >= least).any():
            iou = float(((a & g).sum((1, 2))[union >= least] / union[union >= least]).min())
            worst = iou if worst is None else min(worst, iou)
    return worst


def graph_nms(predictions: Tensor, *, conf: float, iou: float, max_det: int) -> list[Tensor]:
    """What ONNX's NonMaxSuppression op gives for best-class predictions, as rows (box, score, label)
    per image: per class, boxes scoring above ``conf``, greedy at ``iou``, ``max_det`` per class."""
    from torchvision.ops import nms

    out = []
    for preds in predictions:
        scores, labels = preds[:, 4:].max(dim=1)
        rows = []
        for c in labels.unique():
            mask = (labels == c) & (scores > conf)
            keep = nms(preds[mask, :4], scores[mask], iou)[:max_det]
            rows.append(torch.cat((preds[mask, :4][keep], scores[mask][keep, None],
                                   torch.full((len(keep), 1), float(c))), dim=1))
        out.append(torch.cat(rows) if rows else preds.new_zeros(0, 6))
    return out


def row_difference(eager: list[Tensor], got: list[Tensor], score_tol: float) -> tuple[float, float, int]:
    """(largest box difference, largest score difference, largest count difference) between two lists of
    per-image detection rows (x1, y1, x2, y2, score, label), each sorted by score. Boxes are compared at
    the ranks whose scores stand apart from their neighbours' by more than ``2 * score_tol`` (elsewhere
    two near-equal scores may swap) and whose labels agree."""
    box, score, count = 0.0, 0.0, 0
    for e, g in zip(eager, got, strict=True):
        e, g = e[e[:, 4].argsort(descending=True)], g[g[:, 4].argsort(descending=True)]
        n = min(len(e), len(g))
        count = max(count, abs(len(e) - len(g)))
        if n == 0:
            continue
        score = max(score, float((e[:n, 4] - g[:n, 4]).abs().max()))
        gaps = e[:n, 4].diff().abs()
        apart = torch.ones(n, dtype=torch.bool)
        apart[1:] &= gaps > 2 * score_tol
        apart[:-1] &= gaps > 2 * score_tol
        same = apart & (e[:n, 5] == g[:n, 5])
        if same.any():
            box = max(box, float((e[:n, :4][same] - g[:n, :4][same]).abs().max()))
    return box, score, count
