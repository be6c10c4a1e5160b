"""Prediction over any source: frames -> letterboxed batches -> ``Detector.predict`` -> ``Result``s.

``predict_iter`` reads, letterboxes and stacks one batch ahead in a background thread
(decoding and resizing overlap the forward pass) and never holds more than two batches of
decoded images, so memory does not grow with the number of images; ``predict`` adds
saving into a run folder and, with ``stream=False``, collects the results into a list.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from yolokit.data.sources.images import letterbox
from yolokit.models import Detector
from yolokit.predict.results import Result
from yolokit.predict.saving import ResultWriter
from yolokit.predict.sources import Frame, frames

T = TypeVar("T")


def batches(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """Consecutive lists of ``size`` items (the last may be shorter)."""
    if size < 1:
        raise ValueError(f"batch must be >= 1, got {size}")
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def letterbox_batch(images: Sequence[Tensor], imgsz: int, stride: int, *,
                    square: bool = False) -> tuple[Tensor, list[Any]]:
    """Letterboxes Tensor[3, H, W] uint8 images (``yolokit.data.sources.images.letterbox``) into one batch.

    ``imgsz`` is rounded up to a multiple of ``stride``. When every image has the same
    shape the batch is the smallest stride-aligned rectangle around them (less padding,
    faster), otherwise (or with ``square``: a model that takes one size only) the square.

    Returns:
        ``(batch, ratio_pads)``: Tensor[B, 3, H', W'] uint8, and one
        ``((ratio_w, ratio_h), (pad_w, pad_h))`` per image.
    """
    size = math.ceil(imgsz / stride) * stride
    same = not square and len({tuple(im.shape[-2:]) for im in images}) == 1
    boxed = [letterbox(np.ascontiguousarray(im.permute(1, 2, 0).numpy()), size, stride=stride, auto=same)
             for im in images]
    return torch.from_numpy(np.stack([b for b, _ in boxed]).transpose(0, 3, 1, 2)), [rp for _, rp in boxed]


def read_ahead(items: Iterator[T]) -> Iterator[T]:
    """``items``, with the next one produced in a worker thread while the caller uses this one."""
    done = object()
    with ThreadPoolExecutor(1, thread_name_prefix="yolokit-read") as pool:
        pending = pool.submit(next, items, done)
        while True:
            item = pending.result()
            if item is done:
                return
            pending = pool.submit(next, items, done)
            yield item


def predict_iter(
    model: Detector,
    source: Any,
    *,
    imgsz: int = 640,
    conf: float = 0.25,
    iou: float = 0.7,
    max_det: int = 300,
    batch: int = 1,
    classes: Sequence[int] | None = None,
    agnostic: bool = False,
    multi_label: bool = False,
    vid_stride: int = 1,
    nms: bool = True,
) -> Iterator[Result]:
    """Yields one ``Result`` per image or video frame of ``source``, in order, ``batch`` at a time.

    Args:
        model: a Detector (its device and dtype are used; call ``.eval()`` and, for speed,
            ``.fuse()`` first), or an exported file's ``yolokit.deploy.ExportedModel``. Its ``names``
            label the results.
        source: a file, folder, glob, ``.txt`` list, video, camera index, stream URL,
            in-memory image or a list of these (see ``yolokit.predict.sources``).
        imgsz: inference size (rounded up to a stride multiple); images keep their aspect
            ratio and are padded with grey.
        conf: score threshold.
        iou: NMS IoU threshold.
        max_det: most detections per image.
        batch: images per forward pass.
        classes: keep only these classes.
        agnostic: class-agnostic NMS.
        multi_label: keep a box once per class above ``conf``.
        vid_stride: keep every n-th video frame.
        nms: False: an end-to-end model's (YOLO26's) one-to-one detections, a top-k without NMS
            (see ``Detector.predict``).

    Examples:
        >>> for result in predict_iter(model, "clip.mp4", batch=8):
        ...     print(result.frame, result.summary())
        0 2 circle, 1 star
    """
    names, stride = model.names, int(max(model.strides))
    # a segmentation model's masks stay in their boxes (Result makes whole masks only when they are read)
    crops = {"mask_form": "crops"} if "mask_form" in inspect.signature(model.predict).parameters else {}
    square = getattr(model, "fixed_imgsz", None) is not None   # an exported file that takes one size only

    def prepared(chunk: list[Frame]) -> tuple[list[Frame], Tensor, list[Any]]:
        return chunk, *letterbox_batch([f.image for f in chunk], imgsz, stride, square=square)

    for chunk, boxed, ratio_pad in read_ahead(map(prepared, batches(frames(source, vid_stride=vid_stride), batch))):
        dets = model.predict(boxed, orig_shapes=[tuple(f.image.shape[-2:]) for f in chunk], ratio_pad=ratio_pad,
                             conf=conf, iou=iou, max_det=max_det, classes=classes, agnostic=agnostic,
                             multi_label=multi_label, nms=nms, **crops)
        for f, d in zip(chunk, dets, strict=True):
            yield _result(f, d.to("cpu"), names)


def _result(frame: Frame, det: Any, names: list[str]) -> Result:
    return Result(det.boxes, det.scores, det.labels, names, frame.path, frame.name, tuple(frame.image.shape[-2:]),
                  frame.image, frame.frame, frame.fps, getattr(det, "masks", None))


def predict(
    model: Detector,
    source: Any,
    *,
    stream: bool = False,
    out: str | Path | None = None,
    save: bool = True,
    save_txt: bool = False,
    save_conf: bool = False,
    save_json: bool = False,
    save_crop: bool = False,
    **kwargs: Any,
) -> list[Result] | Iterator[Result]:
    """Predicts on ``source`` and, with ``out``, saves into that run folder as results come.

    Args:
        model: a Detector.
        source: anything ``predict_iter`` takes.
        stream: return a generator (constant memory; nothing runs until it is iterated)
            instead of a list of every result (which holds every image).
        out: run folder for outputs (see ``yolokit.predict.saving``); None saves nothing.
        save, save_txt, save_conf, save_json, save_crop: what to write under ``out``.
        **kwargs: ``predict_iter`` options (imgsz, conf, iou, max_det, batch, classes, ...).

    Examples:
        >>> results = predict(model, "images/", out="runs/predict", save_txt=True)
        >>> results[0].boxes.shape, results[0].names[:2]
        (torch.Size([3, 4]), ['person', 'bicycle'])
    """
    results = predict_iter(model, source, **kwargs)
    if out is not None:
        results = _saved(results, ResultWriter(out, save=save, save_txt=save_txt, save_conf=save_conf,
                                               save_json=save_json, save_crop=save_crop))
    return results if stream else list(results)


def _saved(results: Iterator[Result], writer: ResultWriter) -> Iterator[Result]:
    with writer:
        for result in results:
            writer.write(result)
            yield result
