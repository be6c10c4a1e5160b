"""Pure tensor functions: boxes, IoU, NMS, anchors and grids, letterbox geometry, instance masks."""

from yolokit.ops.anchors import anchor_to_box, box_to_dist, dfl_expectation, dist_to_box, grid_points
from yolokit.ops.boxes import (
    box_area,
    box_convert,
    box_iou,
    ciou,
    clip_boxes,
    diou,
    giou,
    iou,
)
from yolokit.ops.geometry import LetterboxPlan, letterbox_plan, unletterbox_boxes
from yolokit.ops.masks import MaskCrops, decode_masks, mask_crops_in_original, mask_logits, masks_in_original
from yolokit.ops.nms import (
    Detections,
    end_to_end_detections,
    end_to_end_points,
    nms_points,
    non_max_suppression,
    top_k_points,
    top_k_predictions,
)

__all__ = [
    "Detections",
    "LetterboxPlan",
    "anchor_to_box",
    "box_area",
    "box_convert",
    "box_iou",
    "box_to_dist",
    "ciou",
    "clip_boxes",
    "dfl_expectation",
    "diou",
    "decode_masks",
    "dist_to_box",
    "end_to_end_detections",
    "end_to_end_points",
    "giou",
    "grid_points",
    "iou",
    "letterbox_plan",
    "mask_logits",
    "masks_in_original",
    "mask_crops_in_original",
    "MaskCrops",
    "nms_points",
    "non_max_suppression",
    "top_k_points",
    "top_k_predictions",
    "unletterbox_boxes",
]
