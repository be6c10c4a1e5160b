"""Run any albumentations pipeline on (image, boxes, classes), boxes kept in step.

albumentations is only imported here, when an adapter is built. The adapter draws
its randomness from the numpy Generator it is called with, so a run stays
reproducible from yolokit's seeds.
"""

from __future__ import annotations

import os
import random
import warnings
from typing import Any

import cv2
import numpy as np


class Albumentations:
    """Adapter from an albumentations Compose (or list of transforms) to yolokit samples.

    The transforms are rebuilt into a Compose whose bounding boxes are `pascal_voc`
    (xyxy pixels) with the class ids as a label field, so geometric transforms move,
    clip and drop boxes consistently with the image.

    Args:
        transforms: an `albumentations.Compose`, one transform, or a list of them.
        bgr: the images given are BGR (yolokit's pipeline order); they are handed to
            albumentations as RGB and converted back.
        min_visibility: boxes keeping less than this share of their area are dropped.
        min_area: boxes smaller than this many square pixels are dropped.

    Examples:
        >>> import albumentations as A  # doctest: +SKIP
        >>> aug = Albumentations([A.HorizontalFlip(p=1.0)])  # doctest: +SKIP
        >>> image, boxes, classes = aug(image, boxes, classes, rng)  # doctest: +SKIP
    """

    def __init__(self, transforms: Any, *, bgr: bool = True, min_visibility: float = 0.0,
                 min_area: float = 0.0) -> None:
        os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")  # no network check
        try:
            import albumentations as A
        except ImportError as exc:
            raise ImportError("an albumentations pipeline needs albumentations (pip install albumentations); "
                              "yolokit's own augmentation does not") from exc

        p = 1.0
        if isinstance(transforms, A.Compose):
            p, items = transforms.p, list(transforms.transforms)
        elif isinstance(transforms, (list, tuple)):
            items = list(transforms)
        else:
            items = [transforms]
        params = A.BboxParams(format="pascal_voc", label_fields=["classes"],
                              min_visibility=min_visibility, min_area=min_area, clip=True)
        with warnings.catch_warnings():  # pipelines without geometric steps are fine
            warnings.filterwarnings("ignore", message="Got processor for bboxes")
            self.compose = A.Compose(items, bbox_params=params, p=p)
        self.bgr = bgr

    def __call__(self, image: np.ndarray, boxes: np.ndarray, classes: np.ndarray,
                 rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Apply the pipeline.

        Args:
            image: uint8 [H, W, 3].
            boxes: float [G, 4] xyxy pixels, inside the image.
            classes: [G] class ids.
            rng: randomness for this call.

        Returns:
            image [H', W', 3], boxes float32 [G', 4], classes int64 [G'].
        """
        self.compose.set_random_state(rng, random.Random(int(rng.integers(2**63))))
        rgb = cv2.cvtColor(image, cv2.COLOR_BGR2RGB) if self.bgr else image
        out = self.compose(image=rgb, bboxes=np.asarray(boxes, np.float32).reshape(-1, 4),
                           classes=np.asarray(classes, np.int64))
        result = out["image"]
        if self.bgr:
            result = cv2.cvtColor(result, cv2.COLOR_RGB2BGR)
        new_boxes = np.asarray(out["bboxes"], np.float32).reshape(-1, 4)
        new_classes = np.asarray(out["classes"], np.int64).reshape(-1)
        return np.ascontiguousarray(result), new_boxes, new_classes

    def __repr__(self) -> str:
        names = ", ".join(type(t).__name__ for t in self.compose.transforms)
        return f"Albumentations([{names}])"
