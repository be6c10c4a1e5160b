"""Detection losses built from a head's facts (classes, strides, reg_max or anchors).

A loss takes the raw maps of ``Detector.forward`` and the batch targets Tensor[N, 6]
rows ``(image_index, class, x1, y1, x2, y2)`` in input pixels, and returns
``(total, parts)`` with ``parts`` a dict of detached named components.
"""

from yolokit.losses.anchor_matcher import AnchorMatcher
from yolokit.losses.assigners import TaskAlignedAssigner
from yolokit.losses.base import DetectionLoss, PaddedTargets, pad_targets
from yolokit.losses.yolo26 import YOLO26Loss
from yolokit.losses.yolo26_seg import YOLO26SegLoss
from yolokit.losses.yolov3 import YOLOv3Loss
from yolokit.losses.yolov8 import YOLOv8Loss
from yolokit.losses.yolov8_seg import YOLOv8SegLoss

__all__ = [
    "AnchorMatcher",
    "DetectionLoss",
    "PaddedTargets",
    "TaskAlignedAssigner",
    "YOLO26Loss",
    "YOLO26SegLoss",
    "YOLOv3Loss",
    "YOLOv8Loss",
    "YOLOv8SegLoss",
    "pad_targets",
]
