"""Other ecosystems' files: Ultralytics and Darknet weights in, safetensors and ONNX out.

``load(path, *, model=None)`` recognises the format and returns a ready Detector;
``save(model, path)`` writes yolokit's own format (or Darknet's, for ``.weights``);
``export_onnx(model, path, *, imgsz=640, nms=False)`` writes an ONNX graph. No file is
ever unpickled with code execution: see ``yolokit.interop.safe_load``. Each format's own
readers and writers are in its module (``native``, ``ultralytics``, ``darknet``, ``formats``).
"""

from yolokit.interop.darknet import read_darknet_header
from yolokit.interop.formats import load, save
from yolokit.interop.onnx import export_onnx
from yolokit.interop.safe_load import UnsafeFileError

__all__ = ["UnsafeFileError", "export_onnx", "load", "read_darknet_header", "save"]
