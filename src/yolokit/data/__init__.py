"""Data: sources (YOLO, COCO, shapes, shards local or in object storage), transforms, Mosaic, albumentations
adapter, loader.

Typical use:
    >>> from yolokit.data import DetectionDataset, build_dataloader  # doctest: +SKIP
    >>> train = DetectionDataset("shapes", "train", imgsz=320, augment=True)  # doctest: +SKIP
    >>> loader = build_dataloader(train, 16, workers=2, seed=0)  # doctest: +SKIP
"""

from yolokit.data.albu import Albumentations
from yolokit.data.color import apply_hsv_lut_batch
from yolokit.data.dataset import DetectionDataset
from yolokit.data.images import ImageError, VideoFrame, image_tensor, letterbox, read_image, read_video, verify_image
from yolokit.data.loader import (
    AspectRatioBatchSampler,
    DetectionLoader,
    RectBatchSampler,
    ShardedBatchSampler,
    build_dataloader,
    collate,
    to_device,
)
from yolokit.data.mosaic import mixup, mosaic4
from yolokit.data.remote import CredentialsError, StoreError
from yolokit.data.shapes import SHAPE_NAMES, make_shapes
from yolokit.data.shards import ShardSummary, write_shards, write_split
from yolokit.data.sources import DatasetError
from yolokit.data.stream import shard_index
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
    "Albumentations", "AspectRatioBatchSampler", "AugmentConfig", "CredentialsError", "DatasetError",
    "DetectionDataset", "DetectionLoader", "ImageError", "RectBatchSampler", "SHAPE_NAMES", "ShardSummary",
    "ShardedBatchSampler", "StoreError", "VideoFrame", "apply_hsv_lut", "apply_hsv_lut_batch", "augment_hsv",
    "build_dataloader", "collate", "flip_lr", "flip_ud", "hsv_lut", "image_tensor", "letterbox", "make_shapes",
    "mixup", "mosaic4", "random_affine", "random_flip", "read_image", "read_video", "scale_boxes", "shard_index",
    "to_device", "transform_boxes", "verify_image", "write_shards", "write_split",
]
