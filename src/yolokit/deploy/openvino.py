"""The OpenVINO export: the ONNX graph converted into an IR folder, float32, float16 weights, or int8.

The folder holds ``<name>.xml`` and ``<name>.bin`` (OpenVINO's IR) and ``yolokit.json``
(``interop.onnx.file_info``). int8 is NNCF's post-training quantization of the converted model,
calibrated on up to ``calibration_images`` letterboxed images of a dataset's train split (the
mixed preset: symmetric weights, asymmetric activations), with the head's convolutions and the
decode's operations (sigmoid, softmax, the DFL's expectation (a MatMul), concatenations and the box
arithmetic) left in float, so that box coordinates and scores are not rounded to 256 levels.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from yolokit.interop.onnx import export_onnx, file_info
from yolokit.models import Detector


def export_openvino(model: Detector, out: str | Path, *, imgsz: tuple[int, int], half: bool = False,
                    int8: bool = False, data: str | None = None, calibration_images: int = 300,
                    **options: Any) -> Path:
    """Writes the OpenVINO folder ``out`` (replaced if it exists); ``options``: ``export_onnx``'s."""
    import openvino as ov

    if int8 and importlib.util.find_spec("nncf") is None:
        raise ImportError("int8 needs the nncf package: pip install 'yolokit[openvino]'")
    h, w = imgsz
    folder, onnx_path = temporary_onnx(model, imgsz=(h, w), **options)
    with folder:
        converted = ov.convert_model(str(onnx_path))
        if int8:
            converted = quantize(converted, model, data, (h, w), calibration_images, head_convolutions(onnx_path))
    out = Path(out)
    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    out.mkdir(parents=True)
    ov.save_model(converted, str(out / f"{model.name}.xml"), compress_to_fp16=half)
    info = file_info(model, h, w, nms=options["nms"], end_to_end=options["end_to_end"], dynamic=options["dynamic"],
                     half=half, conf=options["conf"], iou=options["iou"], max_det=options["max_det"])
    info["int8"] = bool(int8)
    (out / "yolokit.json").write_text(json.dumps(info, indent=1))
    return out


def temporary_onnx(model: Detector, **kwargs: Any) -> tuple[tempfile.TemporaryDirectory, Path]:
    """An ONNX export in a temporary folder (the OpenVINO export converts it)."""
    folder = tempfile.TemporaryDirectory(prefix="yolokit-export-")
    path = Path(folder.name) / f"{model.name}.onnx"
    export_onnx(model, path, **kwargs)
    return folder, path


def calibration_batches(data: str, stride: int, imgsz: tuple[int, int], count: int) -> list[np.ndarray]:
    """Up to ``count`` images of ``data``'s train split, letterboxed to ``imgsz`` as float32 [1, 3, H, W]
    in [0, 1] (RGB): what the exported model takes."""
    from yolokit.data import DetectionDataset

    dataset = DetectionDataset(data, "train", imgsz=max(imgsz), augment=False, rect=False, stride=stride)
    step = max(1, len(dataset) // count)
    batches = []
    for i in range(0, len(dataset), step)[:count]:
        image = dataset[i]["image"]                      # uint8 [3, H, W], RGB, letterboxed
        batches.append(image.numpy()[None].astype(np.float32) / 255)
    return batches


def head_convolutions(onnx_path: Path) -> list[str]:
    """The names of the ONNX graph's convolutions inside the model's head (the exporter records each node's
    module path in its ``namespace`` metadata)."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    return [node.name for node in graph.node if node.op_type == "Conv"
            and any(p.key == "namespace" and "/model.head" in p.value for p in node.metadata_props)]


def quantize(converted: Any, model: Detector, data: str | None, imgsz: tuple[int, int], count: int,
             head: list[str]) -> Any:
    """NNCF's post-training int8 quantization of the converted model, calibrated on ``data``: the head's
    convolutions (``head``) and the decode stay in float, and the biases are corrected in full (not
    NNCF's fast correction). On the demo's yolov8n (float: 0.719 mAP50-95) the first export gave 0.693,
    the head in float and the full correction 0.705; the DFL's MatMul in float too gives 0.720
    (BENCHMARKS.md "Export"): rounded to 256 levels, the expected distance over 16 bins moved box
    sides by up to a bin's share of the stride, which IoU 0.95 notices."""
    import nncf

    batches = calibration_batches(data, int(max(model.strides)), imgsz, count)
    if not batches:
        raise ValueError(f"{data}: no training images to calibrate int8 on")
    ignored = nncf.IgnoredScope(types=["Sigmoid", "Softmax", "MatMul", "Concat", "Sub", "Add", "Mul", "Div"],
                                patterns=[f"^{re.escape(name)}(/.*)?$" for name in head], validate=False)
    nncf.set_log_level(logging.ERROR)   # not a line per operation it leaves in float
    return nncf.quantize(converted, nncf.Dataset(batches), subset_size=len(batches),
                         preset=nncf.QuantizationPreset.MIXED, ignored_scope=ignored, fast_bias_correction=False)
