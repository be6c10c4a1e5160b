"""yolokit: YOLOv3 and YOLOv8 object detection in plain PyTorch.

Example:
    >>> import yolokit
    >>> model = yolokit.create_model("yolov8n", num_classes=80)
    >>> detections = model.predict("path/to/images", conf=0.25)
    >>> model = yolokit.load("yolov8n.pt")  # Ultralytics, Darknet (model=...) or yolokit files
"""

from yolokit.interop import load, save
from yolokit.models import Detector, create_model, list_models
from yolokit.ops.nms import Detections

__version__ = "0.1.0"

__all__ = ["Detections", "Detector", "__version__", "create_model", "list_models", "load", "save"]
