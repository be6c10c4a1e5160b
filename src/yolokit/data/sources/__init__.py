"""Sources: reading a split and its pixels. The readers (YOLO folders with a data.yaml, COCO json, the
built-in shapes set), the split index they return (images, labels and every problem found), what part of
a split trains, and decoding images and video frames.

The layout (tests/test_architecture.py): nothing here imports `yolokit.data.augment` or the loader;
`yolokit.data.store` builds on the split index, and the readers reach it only when a split turns out to
be shards (inside `load_split` and `yolo_index`).
"""

from yolokit.data.sources.images import (
    ImageError,
    VideoFrame,
    decode_image,
    image_tensor,
    letterbox,
    read_image,
    read_video,
    verify_image,
)
from yolokit.data.sources.labels import Problem, SplitIndex
from yolokit.data.sources.readers import DatasetError, coco_index, load_split, read_data_yaml, yolo_index
from yolokit.data.sources.selection import select
from yolokit.data.sources.shapes import SHAPE_NAMES, make_shapes

__all__ = [
    "DatasetError", "ImageError", "Problem", "SHAPE_NAMES", "SplitIndex", "VideoFrame", "coco_index",
    "decode_image", "image_tensor", "letterbox", "load_split", "make_shapes", "read_data_yaml", "read_image",
    "read_video", "select", "verify_image", "yolo_index",
]
