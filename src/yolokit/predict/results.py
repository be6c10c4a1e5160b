"""``Result``: the detections of one image or frame, with what is needed to show and save them."""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np
import torch
from torch import Tensor

from yolokit.ops.masks import MaskCrops
from yolokit.ops.nms import Detections
from yolokit.viz import draw_detections


@dataclass
class Result:
    """Detections of one image or video frame, boxes in its original pixels.

    Attributes:
        boxes: Tensor[K, 4] float32 xyxy in original pixels (CPU).
        scores: Tensor[K] float32 confidences.
        labels: Tensor[K] int64 class indices.
        names: class names by index.
        path: the source: a file path, a stream URL, ``camera<i>`` or ``image<i>``.
        name: the relative path of its outputs in a run folder (see ``Frame.name``).
        orig_shape: (height, width) of the original image.
        image: the original image, Tensor[3, H, W] RGB (uint8; float in [0, 1] is accepted);
            None for a result without pixels (``yolokit val``'s), which cannot be drawn or cropped.
        frame: index of the frame in its video or stream; None for a still image.
        fps: the video's frame rate; None for a still image.
        masks: a segmentation model's: Tensor[K, H, W] bool, each detection's mask in original pixels
            (``polygons()`` gives their outlines); None for a detection model. A result may be made with
            ``ops.masks.MaskCrops`` (each mask inside its box, as ``predict`` makes them): its outlines, label
            rows, JSON records and drawing are made from the crops, and ``masks`` makes the whole masks
            when first read (K x H x W: a 4000 x 3000 photo's 50 masks take 600 MB).

    Printed, it is one line (``Result(path='a.jpg', 640x480, 3 detections: 2 circle, 1 square)``, width
    first); in a notebook, its drawn image (``_repr_png_``); ``show()`` shows that anywhere.
    """

    boxes: Tensor
    scores: Tensor
    labels: Tensor
    names: list[str]
    path: str
    name: str
    orig_shape: tuple[int, int]
    image: Tensor | None
    frame: int | None = None
    fps: float | None = None
    masks: Tensor | None = None

    def __len__(self) -> int:
        return len(self.scores)

    @property
    def detections(self) -> Detections:
        return Detections(self.boxes, self.scores, self.labels, self.masks)

    @property
    def _stored_masks(self) -> Tensor | MaskCrops | None:
        """The masks as given (crops stay crops; ``masks`` makes them whole)."""
        return self.__dict__.get("_masks")

    def _mask_parts(self) -> list[tuple[int, int, np.ndarray]] | None:
        """Each mask as ``(x1, y1, bool array)``: its crop at its window's corner (whole masks: at 0, 0), without
        making whole masks of crops; None without masks."""
        stored = self._stored_masks
        if stored is None:
            return None
        if isinstance(stored, MaskCrops):
            stored = stored.to("cpu")
            return [(x1, y1, c.numpy()) for (x1, y1, _, _), c in zip(stored.windows.tolist(), stored.crops,
                                                                        strict=True)]
        return [(0, 0, m) for m in stored.detach().cpu().bool().numpy()]

    def polygons(self) -> list[np.ndarray]:
        """Each detection's mask outline: float32 [N, 2] (x, y) in original pixels, its largest outer contour
        (OpenCV's, corners kept); an empty mask gives its box's four corners. Raises ValueError without masks."""
        parts = self._mask_parts()
        if parts is None:
            raise ValueError(f"the result of {self.path} has no masks (a detection model's)")
        out = []
        for (left, top, mask), (x1, y1, x2, y2) in zip(parts, self.boxes.tolist(), strict=True):
            contours, _ = cv2.findContours(mask.astype(np.uint8), cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE,
                                           offset=(left, top))
            if contours:
                out.append(max(contours, key=len).reshape(-1, 2).astype(np.float32))
            else:
                out.append(np.array([[x1, y1], [x2, y1], [x2, y2], [x1, y2]], np.float32))
        return out

    @property
    def orig_img(self) -> np.ndarray:
        """The original image as an HxWx3 uint8 RGB array."""
        image = self.image
        if image is None:
            raise ValueError(f"the result of {self.path} holds no image to draw or crop")
        if image.is_floating_point():
            image = (image.clamp(0, 1) * 255).round().to(torch.uint8)
        return np.ascontiguousarray(image.permute(1, 2, 0).cpu().numpy())

    def class_name(self, label: int) -> str:
        return self.names[label] if 0 <= label < len(self.names) else str(label)

    def plot(self, *, scores: bool = True, line_width: int | None = None) -> np.ndarray:
        """The original image with boxes, class names (and scores) drawn: HxWx3 uint8 RGB.

        Line width and font grow with the image (2 px and a small font up to ~700 px).
        """
        h, w = self.orig_shape
        width = line_width or max(2, round((h + w) / 2 * 0.003))
        drawn = Detections(self.boxes, self.scores, self.labels, self._stored_masks)   # crops as they are
        return draw_detections(self.orig_img, drawn, self.names, thickness=width,
                               font_scale=max(0.4, width / 4), show_scores=scores)

    def records(self) -> list[dict[str, Any]]:
        """One dict per detection: ``name``, ``class``, ``confidence``, ``box`` {x1, y1, x2, y2}."""
        return [{"name": self.class_name(c), "class": c, "confidence": round(s, 5),
                 "box": dict(zip(("x1", "y1", "x2", "y2"), (round(v, 2) for v in b), strict=True))}
                for b, s, c in zip(self.boxes.tolist(), self.scores.tolist(), self.labels.tolist(), strict=True)]

    def to_json(self) -> str:
        """``records()`` as a JSON string."""
        return json.dumps(self.records())

    def txt_lines(self, *, save_conf: bool = False) -> list[str]:
        """YOLO label lines: ``class cx cy w h`` normalized to [0, 1] (then the score with ``save_conf``); with
        masks, YOLO segmentation rows ``class x1 y1 x2 y2 ...`` (``polygons()``, normalized)."""
        h, w = self.orig_shape
        lines = []
        if self._stored_masks is not None:
            for poly, s, c in zip(self.polygons(), self.scores.tolist(), self.labels.tolist(), strict=True):
                points = " ".join(f"{x / w:.6f} {y / h:.6f}" for x, y in poly.tolist())
                lines.append(f"{c} {points}" + (f" {s:.6g}" if save_conf else ""))
            return lines
        for (x1, y1, x2, y2), s, c in zip(self.boxes.tolist(), self.scores.tolist(), self.labels.tolist(), strict=True):
            values = [(x1 + x2) / 2 / w, (y1 + y2) / 2 / h, (x2 - x1) / w, (y2 - y1) / h]
            conf = f" {s:.6g}" if save_conf else ""
            lines.append(f"{c} " + " ".join(f"{v:.6f}" for v in values) + conf)
        return lines

    def coco(self, image_id: int | str, category_ids: Sequence[int] | None = None) -> list[dict[str, Any]]:
        """COCO detection results: ``image_id``, ``category_id``, ``bbox`` [x, y, w, h] in pixels,
        ``score``, and with masks ``segmentation`` (COCO RLE, what ``COCO.loadRes`` reads for ``segm``).
        ``category_id`` is the class index, or ``category_ids[class]`` when given (a COCO json's ids,
        ``DetectionDataset.category_ids``)."""
        ids = list(category_ids) if category_ids is not None else None
        out = [{"image_id": image_id, "category_id": ids[c] if ids is not None else c,
                "bbox": [round(x1, 3), round(y1, 3), round(x2 - x1, 3), round(y2 - y1, 3)], "score": round(s, 5)}
               for (x1, y1, x2, y2), s, c in zip(self.boxes.tolist(), self.scores.tolist(), self.labels.tolist(),
                                                 strict=True)]
        parts = self._mask_parts()
        if parts is not None:               # COCO's segm results: each mask as an uncompressed-counts RLE
            from pycocotools import mask as mask_utils

            h, w = self.orig_shape
            for row, (left, top, crop) in zip(out, parts, strict=True):
                whole = np.zeros((h, w), np.uint8, order="F")     # one whole mask at a time
                whole[top:top + crop.shape[0], left:left + crop.shape[1]] = crop
                rle = mask_utils.encode(whole)
                row["segmentation"] = {"size": [int(v) for v in rle["size"]], "counts": rle["counts"].decode()}
        return out

    def crops(self) -> list[tuple[int, np.ndarray]]:
        """(class, HxWx3 uint8 RGB cut-out) per detection; boxes rounded outwards, at least 1 px."""
        image = self.orig_img
        h, w = image.shape[:2]
        out = []
        for (x1, y1, x2, y2), c in zip(self.boxes.tolist(), self.labels.tolist(), strict=True):
            left, top = min(max(int(np.floor(x1)), 0), w - 1), min(max(int(np.floor(y1)), 0), h - 1)
            right, bottom = max(min(int(np.ceil(x2)), w), left + 1), max(min(int(np.ceil(y2)), h), top + 1)
            out.append((c, image[top:bottom, left:right].copy()))
        return out

    def summary(self, most: int | None = None) -> str:
        """``"2 circle, 1 star"`` (or ``"no detections"``), most frequent first; with ``most``, that many
        classes at most, then how many more (``"5 car, 2 dog, +3 classes"``)."""
        counts = Counter(self.class_name(c) for c in self.labels.tolist()).most_common()
        parts = [f"{n} {name}" for name, n in counts[:most]]
        more = len(counts) - len(parts)
        return ", ".join(parts + ([f"+{more} classes"] if more else [])) or "no detections"

    def __repr__(self) -> str:
        frame = "" if self.frame is None else f", frame={self.frame}"
        (h, w), n = self.orig_shape, len(self)
        found = f"{n} detection{'s' if n > 1 else ''}: {self.summary(most=5)}" if n else "no detections"
        return f"Result(path={self.path!r}{frame}, {w}x{h}, {found})"

    def _repr_png_(self) -> bytes | None:
        """``plot()`` as PNG bytes, what a notebook shows for the result; None when it holds no image."""
        if self.image is None:
            return None
        ok, png = cv2.imencode(".png", cv2.cvtColor(self.plot(), cv2.COLOR_RGB2BGR))
        return png.tobytes() if ok else None

    def show(self) -> None:
        """Shows ``plot()``: in IPython (a notebook) as the cell's output, elsewhere in a matplotlib
        figure (``plt.show()``: a window, or nothing with a non-interactive backend such as Agg)."""
        ipython = sys.modules.get("IPython")   # loaded in every IPython session; never imported here
        if ipython is not None and ipython.get_ipython() is not None:
            from IPython.display import display

            display(self)
            return
        import matplotlib.pyplot as plt

        drawn = self.plot()
        plt.figure()
        plt.imshow(drawn)
        plt.axis("off")
        plt.title(self.path if self.frame is None else f"{self.path} frame {self.frame}", fontsize=9)
        plt.show()


def _masks(result: Result) -> Tensor | None:
    """``Result.masks``: whole masks, made from crops when first read (then kept)."""
    stored = result._stored_masks
    if isinstance(stored, MaskCrops):
        stored = result.__dict__["_masks"] = stored.to("cpu").dense(result.orig_shape)
    return stored


def _set_masks(result: Result, value: Tensor | MaskCrops | None) -> None:
    result.__dict__["_masks"] = value


Result.masks = property(_masks, _set_masks, doc=_masks.__doc__)   # the dataclass's field, read through it
