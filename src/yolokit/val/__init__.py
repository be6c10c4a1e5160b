"""Validation: the pass over a labelled split (:func:`validate`), box metrics over arrays, and a segmentation
model's mask metrics (:mod:`yolokit.val.masks`: masks in original pixels against the split's polygons).

Examples:
    >>> import yolokit
    >>> from yolokit.data import DetectionDataset, build_dataloader
    >>> from yolokit.val import validate
    >>> model = yolokit.load("runs/train/weights/model.pt")
    >>> loader = build_dataloader(DetectionDataset("data.yaml", "val", imgsz=640, rect=True), 16, shuffle=False)
    >>> result, _ = validate(model, loader, num_classes=model.num_classes)
    >>> print(result.format_table(model.names))
"""

from yolokit.val.loop import validate
from yolokit.val.masks import mask_scores, polygon_masks
from yolokit.val.metrics import EvalResult, coco_evaluate

__all__ = ["EvalResult", "coco_evaluate", "mask_scores", "polygon_masks", "validate"]
