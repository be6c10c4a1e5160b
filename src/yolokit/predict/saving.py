"""Writing prediction results into a run folder, as they come, with constant memory.

Layout of a run folder (``name`` is a result's relative path, see ``Frame.name``)::

    <run>/<name>                         annotated image, the source's relative path
    <run>/<stem>.mp4                     annotated video, at the source's frame rate
    <run>/labels/<stem>.txt              YOLO labels: class cx cy w h [conf] (videos: <stem>_<frame>.txt)
    <run>/crops/<class>/<stem>_<k>.jpg   each detection cut out of the original image
    <run>/predictions.json               COCO detection results of every image

``<stem>`` is ``name`` without its suffix; if two sources share a stem (``a.jpg`` and
``a.png``) the later one's outputs get the suffix in their stem (``a_png``), so nothing is
overwritten. The JSON array is written entry by entry, never held in memory.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import cv2
import numpy as np

from yolokit.predict.results import Result

WRITABLE_IMAGE_SUFFIXES = frozenset({".bmp", ".jpeg", ".jpg", ".png", ".tif", ".tiff", ".webp"})


def next_run_dir(base: str | Path) -> Path:
    """``base`` if it does not exist yet, else ``base2``, ``base3``, ... (the first free one)."""
    base = Path(base)
    if not base.exists():
        return base
    n = 2
    while base.with_name(f"{base.name}{n}").exists():
        n += 1
    return base.with_name(f"{base.name}{n}")


class ResultWriter:
    """Saves results as they are predicted; ``close()`` finishes videos and the JSON file.

    Args:
        out: the run folder (created).
        save: annotated images and videos.
        save_txt: YOLO label files.
        save_conf: scores in the label files.
        save_json: ``predictions.json`` with COCO results; ``image_id`` is the one given to
            ``write``, else the stem when it is a number (COCO's file names), else the stem
            as a string.
        save_crop: one image per detection under ``crops/<class name>/``.
        category_ids: the JSON's ``category_id`` of each class index (a COCO json's ids,
            ``DetectionDataset.category_ids``); None writes the class index.

    Use as a context manager, or call ``close()``.
    """

    def __init__(self, out: str | Path, *, save: bool = True, save_txt: bool = False, save_conf: bool = False,
                 save_json: bool = False, save_crop: bool = False, category_ids: Sequence[int] | None = None):
        self.out = Path(out)
        self.category_ids = list(category_ids) if category_ids is not None else None
        self.out.mkdir(parents=True, exist_ok=True)
        self.save, self.save_txt, self.save_conf, self.save_crop = save, save_txt, save_conf, save_crop
        self.stems: dict[str, str] = {}  # result name -> unique stem
        self.taken: set[str] = set()
        self.video: tuple[str, cv2.VideoWriter] | None = None
        self.json = None
        self.json_entries = 0
        if save_json:
            self.json = (self.out / "predictions.json").open("w")
            self.json.write("[")

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stem(self, result: Result) -> str:
        """The unique stem (relative path without suffix) of a result's outputs."""
        key = result.name
        if key not in self.stems:
            name = PurePosixPath(key)
            stem = name.with_suffix("").as_posix()
            if stem in self.taken:
                stem = f"{stem}_{name.suffix.lstrip('.')}"
            while stem in self.taken:
                stem += "_"
            self.taken.add(stem)
            self.stems[key] = stem
        return self.stems[key]

    def write(self, result: Result, image_id: int | str | None = None) -> None:
        """Saves one result (a frame of a video, at ``result.fps``, when ``result.frame`` is set);
        ``image_id`` names it in the JSON (default: from its stem)."""
        stem = self.stem(result)
        frame_stem = stem if result.frame is None else f"{stem}_{result.frame}"
        if self.save:
            drawn = np.ascontiguousarray(result.plot()[..., ::-1])
            if result.frame is None:
                name = PurePosixPath(result.name)
                keep = name.suffix.lower() in WRITABLE_IMAGE_SUFFIXES
                self._imwrite(self.out / (result.name if keep else f"{stem}.jpg"), drawn)
            else:
                self._video_frame(stem, drawn, result.fps or 30.0)
        if self.save_txt:
            path = self.out / "labels" / f"{frame_stem}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            lines = result.txt_lines(save_conf=self.save_conf)
            path.write_text("".join(line + "\n" for line in lines))
        if self.save_crop:
            for k, (label, crop) in enumerate(result.crops()):
                self._imwrite(self.out / "crops" / result.class_name(label) / f"{frame_stem}_{k}.jpg",
                              np.ascontiguousarray(crop[..., ::-1]))
        if self.json is not None:
            last = PurePosixPath(frame_stem).name
            if image_id is None:
                image_id = int(last) if last.isdigit() else frame_stem
            for record in result.coco(image_id, self.category_ids):
                self.json.write(("," if self.json_entries else "") + "\n" + json.dumps(record))
                self.json_entries += 1

    def validation_sink(self, names: list[str], image_ids: Sequence[int | str] | None = None
                        ) -> Callable[[int, str, tuple[int, int], Any], None]:
        """An ``on_image`` callable for ``yolokit.train.validate``: writes each image's detections
        as a ``Result`` without pixels (label file ``labels/<file stem>.txt``, JSON records).

        Args:
            names: class names by index.
            image_ids: the JSON's ``image_id`` by dataset index (``DetectionDataset.image_ids``
                of a COCO json); None names images by their file stem.

        Raises:
            ValueError: the writer draws images or crops (``save``, ``save_crop``), which
                need the pixels validation does not keep.
        """
        if self.save or self.save_crop:
            raise ValueError("validation results carry no pixels: make the writer with save=False, save_crop=False")
        ids = list(image_ids) if image_ids is not None else None

        def write(index: int, path: str, shape: tuple[int, int], det: Any) -> None:
            result = Result(det.boxes, det.scores, det.labels, names, path, Path(path).name, tuple(shape), None,
                            masks=getattr(det, "masks", None))
            self.write(result, None if ids is None else ids[index])

        write.takes_mask_crops = True     # validation passes a segmentation model's masks as crops (ops.masks)
        return write

    def _imwrite(self, path: Path, bgr: np.ndarray) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not cv2.imwrite(str(path), bgr):
            raise OSError(f"could not write {path}")

    def _video_frame(self, stem: str, bgr: np.ndarray, fps: float) -> None:
        """Appends a frame to ``<stem>.mp4``, opening it (and closing the previous video) on a new stem."""
        if self.video is None or self.video[0] != stem:
            self._close_video()
            path = self.out / f"{stem}.mp4"
            path.parent.mkdir(parents=True, exist_ok=True)
            h, w = bgr.shape[:2]
            writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (w, h))
            if not writer.isOpened():
                raise OSError(f"OpenCV cannot write video {path}")
            self.video = (stem, writer)
        self.video[1].write(bgr)

    def _close_video(self) -> None:
        if self.video is not None:
            self.video[1].release()
            self.video = None

    def close(self) -> None:
        """Finishes the open video and the JSON file."""
        self._close_video()
        if self.json is not None:
            self.json.write("\n]\n")
            self.json.close()
            self.json = None
