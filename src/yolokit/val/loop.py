"""The validation pass: a model over a labelled split, scored in original image pixels."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from yolokit.accel import distributed
from yolokit.accel.agreement import first_failure
from yolokit.data import to_device
from yolokit.data.sources.images import ImageError, decode_image, read_image
from yolokit.data.store.remote import StoreError, StoreStopped, one_line
from yolokit.ops.geometry import unletterbox_boxes
from yolokit.ops.masks import MaskCrops
from yolokit.ops.nms import Detections
from yolokit.val.masks import mask_record, mask_scores
from yolokit.val.metrics import EvalResult, coco_evaluate

Sample = tuple[np.ndarray, Detections, Detections]  # (original RGB image, predictions, ground truth)
ImageSink = Callable[[int, str, tuple[int, int], Detections], Any]  # (dataset index, path, (h, w), detections)


@torch.inference_mode()
def validate(
    model: nn.Module,
    loader: Iterable[dict[str, Any]],
    *,
    num_classes: int,
    conf: float = 0.001,
    iou: float = 0.7,
    max_det: int = 300,
    keep_samples: int = 0,
    multi_label: bool = True,
    progress: bool = False,
    on_image: ImageSink | None = None,
    world_size: int | None = None,
    nms: bool = True,
) -> tuple[EvalResult, list[Sample]]:
    """Runs ``model`` over a validation loader and scores it in original image pixels.

    The defaults are the usual YOLO validation protocol (the published YOLOv8 numbers):
    multi-label NMS (a box kept once per class scoring above ``conf``), conf 0.001, IoU
    0.7, at most 300 detections per image.

    Under several processes each rank runs its shard of the split (``build_dataloader``
    shards it); the per-image predictions and ground truth of all ranks are gathered and
    every rank scores the whole split, in dataset-index order (as one process does), so
    the result (metrics, per-class table, confusion matrix) equals a one-process
    validation of the same weights.

    Args:
        model: a ``Detector`` (not DDP-wrapped) or an exported file's ``yolokit.deploy.ExportedModel``,
            put in eval mode for the pass; inputs are
            cast to its parameters' dtype (a ``.half()`` model on CUDA runs in float16).
        loader: batches of the batch contract (``images``, ``targets``, ``orig_shapes``,
            ``ratio_pad``, ``paths``, ``indices``).
        num_classes: number of classes.
        conf: score threshold (low, as for mAP).
        iou: NMS IoU threshold.
        max_det: detections kept per image.
        keep_samples: also return this many (original RGB image, predictions, ground
            truth) triples of this rank, for plots; ground truth scores are 1.
        multi_label: multi-label NMS (the protocol); False keeps each box's best class only.
        progress: show a tqdm progress bar over the batches.
        on_image: called as ``on_image(index, path, (height, width), detections)`` for each
            image this rank runs, as its batch is predicted (loader order): its dataset
            index, file and original shape, and the detections it is scored with (CPU,
            original pixels). Under several processes each rank calls it for its own shard
            only. ``ResultWriter.validation_sink`` writes them as COCO results and labels. A
            segmentation model's masks come whole ([K, H, W]), or as ``ops.masks.MaskCrops`` to a
            callable whose ``takes_mask_crops`` is True (as that sink's).
        world_size: the processes sharing the split; default: the process group's.
        nms: False scores an end-to-end model's (YOLO26's) one-to-one detections (a top-``max_det``
            without NMS; ``iou`` and ``multi_label`` do not apply).

    Returns:
        ``(result, samples)``; ``result.names`` are the class names of the loader's dataset, else the
        model's, when they number ``num_classes``. A segmentation model on a set with polygons also gets
        mask mAP (``result.mask_map50``, ``result.mask_map50_95``: ``yolokit.val.masks``).
    """
    device = model_device(model)
    records, samples = [], []  # per image: (dataset index, detections, (boxes, labels), shape)
    batches = tqdm(loader, desc="val", disable=not progress, dynamic_ncols=True, leave=False)
    world = world_size if world_size is not None else distributed.world_size()
    stopped = None
    try:
        _run(model, batches, loader, device, records, samples, conf=conf, iou=iou, max_det=max_det,
             multi_label=multi_label, nms=nms, keep_samples=keep_samples, on_image=on_image)
    except StoreError as exc:     # several processes: every rank learns it before they gather (none waits)
        if world <= 1:
            raise
        stopped = exc
    if world > 1:
        failure = first_failure(None if stopped is None else one_line(stopped))
        if failure is not None:
            raise StoreStopped.of(failure, distributed.rank())
        records = [r for part in distributed.all_gather_object(records) for r in part]
    records.sort(key=lambda r: r[0])
    predictions, targets, shapes = ([r[k] for r in records] for k in (1, 2, 3))
    result = coco_evaluate(predictions, targets, shapes, num_classes, names=class_names(model, loader, num_classes))
    if records and all(r[4] is not None for r in records):   # a segmentation model on a set with polygons
        masks = mask_scores([r[4] for r in records], [r[1].scores.numpy() for r in records],
                            [r[1].labels.numpy() for r in records], num_classes)
        result.mask_map50, result.mask_map50_95 = masks.map50, masks.map50_95
        result.per_class_mask_ap50, result.per_class_mask_ap = masks.per_class_ap50, masks.per_class_ap
        result.mask_precision, result.mask_recall = masks.precision, masks.recall
        result.per_class_mask_precision, result.per_class_mask_recall = masks.per_class_precision, \
            masks.per_class_recall
    return result, samples


def class_names(model: Any, loader: Any, num_classes: int) -> list[str] | None:
    """The classes' names: the loader's dataset's (``DetectionDataset.names``), else the model's; None when
    neither has ``num_classes`` of them."""
    for names in (getattr(getattr(loader, "dataset", None), "names", None), getattr(model, "names", None)):
        if isinstance(names, dict):
            names = [names.get(k, str(k)) for k in range(num_classes)]
        if isinstance(names, (list, tuple)) and len(names) == num_classes:
            return [str(n) for n in names]
    return None


def _run(model: Any, batches: Iterable[dict[str, Any]], loader: Any, device: torch.device, records: list,
         samples: list, *, conf: float, iou: float, max_det: int, multi_label: bool, nms: bool, keep_samples: int,
         on_image: ImageSink | None) -> None:
    """``validate``'s pass over this rank's batches: each image's record (and the first samples) appended."""
    dataset = getattr(loader, "dataset", None)
    segments = bool(getattr(getattr(model, "head", None), "segments", False))    # a segmentation Detector:
    crops = dict(mask_form="crops") if segments else {}                          # its masks kept in their boxes
    for batch in batches:
        batch = to_device(batch, device, non_blocking=True)
        dets = model.predict(batch["images"], conf=conf, iou=iou, max_det=max_det, multi_label=multi_label,
                             orig_shapes=batch["orig_shapes"], ratio_pad=batch["ratio_pad"], nms=nms, **crops)
        rows = batch["targets"].cpu()
        indices = batch.get("indices") or [len(records) + i for i in range(len(dets))]
        for i, (det, shape, rp) in enumerate(zip(dets, batch["orig_shapes"], batch["ratio_pad"], strict=True)):
            mine = rows[rows[:, 0] == i]
            boxes = unletterbox_boxes(mine[:, 2:6], rp, shape) if len(mine) else mine[:, 2:6]
            det, labels = det.to("cpu"), mine[:, 1].long()
            masks = mask_record(det.masks, dataset, int(indices[i]), tuple(shape))   # cropped: kept compact
            boxes_only = Detections(det.boxes, det.scores, det.labels)   # [K, H, W] masks are not kept per image
            records.append((int(indices[i]), boxes_only, (boxes.numpy(), labels.numpy()), tuple(shape), masks))
            if on_image is not None:          # a sink that says it takes crops (predict's writer) gets them
                on_image(int(indices[i]), batch["paths"][i], tuple(shape),
                         det if getattr(on_image, "takes_mask_crops", False) else _whole(det, shape))
            if len(samples) < keep_samples:
                samples.append((_original_rgb(dataset, int(indices[i]), batch["paths"][i], shape),
                                *_sample_detections(det, boxes_only, boxes.float(), labels, masks, dataset,
                                                    int(indices[i]), shape)))


def _whole(det: Detections, shape: tuple[int, int]) -> Detections:
    """``det`` with whole-image masks (``MaskCrops.dense``), for what reads them so: a sink, a sample's."""
    if not isinstance(det.masks, MaskCrops):
        return det
    return Detections(det.boxes, det.scores, det.labels, det.masks.dense(shape))


SAMPLE_MIN_SCORE = 0.25   # the samples keep the masks of the predictions a samples plot shows (its default)


def _sample_detections(det: Detections, boxes_only: Detections, boxes: torch.Tensor, labels: torch.Tensor,
                       masks: Any, dataset: Any, index: int, shape: tuple[int, int]) -> tuple[Detections, Detections]:
    """A sample's predictions and ground truth. For a segmentation model with masks (whole images): the
    predictions scoring at least ``SAMPLE_MIN_SCORE`` only (all of them would be up to max_det whole images),
    and the ground truth as the set's rows, each with its polygon's mask (``mask_record``'s, in their order)."""
    if masks is None or det.masks is None:
        return boxes_only, Detections(boxes, torch.ones(len(labels)), labels)
    keep = det.scores >= SAMPLE_MIN_SCORE
    rows = torch.from_numpy(np.asarray(dataset.index.labels[index], np.float32).reshape(-1, 5))
    kept = Detections(det.boxes[keep], det.scores[keep], det.labels[keep], det.masks[keep])
    return (_whole(kept, shape),
            Detections(rows[:, 1:5], torch.ones(len(rows)), torch.from_numpy(masks[2]).long(),
                       torch.from_numpy(masks[1].dense(shape))))


def model_device(model: Any) -> torch.device:
    """Where a model's input goes: a Detector's parameters' device, an exported file's ``device``."""
    device = getattr(model, "device", None)
    return device if isinstance(device, torch.device) else next(model.parameters()).device


def _original_rgb(dataset: Any, index: int, path: str, shape: tuple[int, int]) -> np.ndarray:
    """The original image as RGB, from the dataset's own source (a file or a shard, by ``index``) or else
    its file; grey if it cannot be read (a sample plot never stops a validation)."""
    try:
        source = getattr(dataset, "index", None)
        image = decode_image(source.image_bytes(index)) if hasattr(source, "image_bytes") else read_image(path)
        return np.ascontiguousarray(image[..., ::-1])
    except (ImageError, OSError, StoreError):
        return np.full((*shape, 3), 114, np.uint8)
