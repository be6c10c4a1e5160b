"""Other ecosystems' files: Ultralytics and Darknet weights in, safetensors and ONNX out.

``load(path, *, model=None)`` recognises the format and returns a ready Detector;
``save(model, path)`` writes yolokit's own format (or Darknet's, for ``.weights``);
``export_onnx(model, path, *, imgsz=640, nms=False)`` writes an ONNX graph. No file is
ever unpickled with code execution: see ``yolokit.interop.safe_load``.
"""

from yolokit.interop.darknet import (
    DarknetHeader,
    darknet_order,
    load_darknet,
    load_darknet_model,
    read_darknet_header,
    save_darknet,
)
from yolokit.interop.formats import FORMATS, Format, file_format, load, save
from yolokit.interop.native import load_native, save_native
from yolokit.interop.onnx import export_onnx
from yolokit.interop.safe_load import UnsafeFileError
from yolokit.interop.ultralytics import load_ultralytics, read_ultralytics, ultralytics_to_yolokit

__all__ = [
    "FORMATS",
    "DarknetHeader",
    "Format",
    "UnsafeFileError",
    "darknet_order",
    "export_onnx",
    "file_format",
    "load",
    "load_darknet",
    "load_darknet_model",
    "load_native",
    "load_ultralytics",
    "read_darknet_header",
    "read_ultralytics",
    "save",
    "save_darknet",
    "save_native",
    "ultralytics_to_yolokit",
]
