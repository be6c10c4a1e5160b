"""Augmentation, in the loader's workers and on the training device: the transforms on numpy arrays
(affine, HSV, flips), Mosaic and MixUp, the albumentations adapter, and the device path: the workers draw
a recipe per image (`recipes`), the device turns a batch of recipes into images (`device_augment`, its
per-pixel stages compiled by `fused`, on a CUDA stream of its own, `pass_stream`; HSV by `color`).

The layout (tests/test_architecture.py): augmentation reads pixels through `yolokit.data.sources` and
writes a batch of recipes into the workers' shared buffers (`yolokit.data.buffers`); it imports nothing
of `yolokit.data.store` and nothing of the loader itself.
"""

from yolokit.data.augment.albu import Albumentations
from yolokit.data.augment.color import apply_hsv_lut_batch
from yolokit.data.augment.device_augment import augment_batch
from yolokit.data.augment.mosaic import mixup, mosaic4
from yolokit.data.augment.recipes import collate_recipes, train_recipe
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

__all__ = [
    "Albumentations", "AugmentConfig", "apply_hsv_lut", "apply_hsv_lut_batch", "augment_batch", "augment_hsv",
    "collate_recipes", "flip_lr", "flip_ud", "hsv_lut", "mixup", "mosaic4", "random_affine", "random_flip",
    "scale_boxes", "train_recipe", "transform_boxes",
]
