"""Data: sources (YOLO, COCO, shapes, shards local or in object storage), transforms, Mosaic, albumentations
adapter, loader.

In three subpackages and the loader: `yolokit.data.sources` reads a split and its pixels,
`yolokit.data.augment` augments (in the loader's workers or on the device), `yolokit.data.store` keeps
images (shards, local or in object storage, and the RAM and disk caches); the dataset, the samplers and
the loader with its workers sit here and assemble them. Every public name is importable from here.

Typical use:
    >>> from yolokit.data import DetectionDataset, build_dataloader  # doctest: +SKIP
    >>> train = DetectionDataset("shapes", "train", imgsz=320, augment=True)  # doctest: +SKIP
    >>> loader = build_dataloader(train, 16, workers=2, seed=0)  # doctest: +SKIP
"""

from yolokit.data.augment.albu import Albumentations
from yolokit.data.augment.color import apply_hsv_lut_batch
from yolokit.data.augment.mosaic import mixup, mosaic4
from yolokit.data.augment.transforms import (
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
from yolokit.data.dataset import DetectionDataset
from yolokit.data.loader import (
    AspectRatioBatchSampler,
    DetectionLoader,
    RectBatchSampler,
    ShardedBatchSampler,
    build_dataloader,
    collate,
    to_device,
)
from yolokit.data.sources.images import (
    ImageError,
    VideoFrame,
    image_tensor,
    letterbox,
    read_image,
    read_video,
    verify_image,
)
from yolokit.data.sources.readers import DatasetError
from yolokit.data.sources.shapes import SHAPE_NAMES, make_shapes
from yolokit.data.store.remote import CredentialsError, StoreError
from yolokit.data.store.shards import ShardSummary, write_shards, write_split
from yolokit.data.store.stream import shard_index

__all__ = [
    "Albumentations", "AspectRatioBatchSampler", "AugmentConfig", "CredentialsError", "DatasetError",
    "DetectionDataset", "DetectionLoader", "ImageError", "RectBatchSampler", "SHAPE_NAMES", "ShardSummary",
    "ShardedBatchSampler", "StoreError", "VideoFrame", "apply_hsv_lut", "apply_hsv_lut_batch", "augment_hsv",
    "build_dataloader", "collate", "flip_lr", "flip_ud", "hsv_lut", "image_tensor", "letterbox", "make_shapes",
    "mixup", "mosaic4", "random_affine", "random_flip", "read_image", "read_video", "scale_boxes", "shard_index",
    "to_device", "transform_boxes", "verify_image", "write_shards", "write_split",
]
