"""Data: sources (YOLO, COCO, shapes), transforms, Mosaic, albumentations adapter, loader.

Typical use:
    >>> from yolokit.data import DetectionDataset, build_dataloader  # doctest: +SKIP
    >>> train = DetectionDataset("shapes", "train", imgsz=320, augment=True)  # doctest: +SKIP
    >>> loader = build_dataloader(train, 16, workers=2, seed=0)  # doctest: +SKIP
"""

from yolokit.data.albu import Albumentations
from yolokit.data.color import apply_hsv_lut_batch
from yolokit.data.dataset import DetectionDataset
from yolokit.data.images import ImageError, VideoFrame, image_tensor, letterbox, read_image, read_video, verify_image
from yolokit.data.labels import Problem, SplitIndex
from yolokit.data.loader import (
    AspectRatioBatchSampler,
    DetectionLoader,
    RectBatchSampler,
    ShardedBatchSampler,
    build_dataloader,
    collate,
    collate_uint8,
    to_device,
)
from yolokit.data.mosaic import MosaicCanvas, mixup, mosaic4, mosaic4_canvas
from yolokit.data.shapes import SHAPE_NAMES, make_shapes
from yolokit.data.sources import (
    DatasetError,
    coco_index,
    label_path,
    load_split,
    read_data_yaml,
    yolo_index,
)
from yolokit.data.transforms import (
    AugmentConfig,
    apply_hsv_lut,
    augment_hsv,
    flip_lr,
    flip_ud,
    hsv_lut,
    random_affine,
    random_flip,
    scale_boxes,
    transform_boxes,
)

__all__ = [
    "Albumentations", "AspectRatioBatchSampler", "AugmentConfig", "DatasetError",
    "DetectionDataset", "DetectionLoader", "ImageError", "Problem", "SHAPE_NAMES", "ShardedBatchSampler", "SplitIndex",
    "apply_hsv_lut", "apply_hsv_lut_batch", "augment_hsv", "build_dataloader", "hsv_lut",
    "coco_index", "collate", "collate_uint8", "flip_lr",
    "flip_ud", "RectBatchSampler",
    "MosaicCanvas", "label_path", "letterbox", "load_split", "make_shapes", "mixup", "mosaic4", "mosaic4_canvas",
    "random_affine", "random_flip", "read_data_yaml", "read_image", "scale_boxes", "to_device",
    "transform_boxes", "verify_image", "yolo_index", "VideoFrame", "image_tensor", "read_video",
]
