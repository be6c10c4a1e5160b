"""The benchmark cases: for each, what yolokit runs and what the reference runs.

A case builds ``Row`` objects, each a pair of callables doing the same work from the same
inputs (the reference one is ``None`` when Ultralytics is not importable, or has no
counterpart). ``harness.runner.run`` times the pairs in turns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

import yolokit
from harness import inputs
from harness.timing import Timed
from yolokit.accel import Precision
from yolokit.losses import TaskAlignedAssigner, YOLOv3Loss, YOLOv8Loss, pad_targets
from yolokit.models import prefers_channels_last
from yolokit.ops import Detections, non_max_suppression
from yolokit.ops.anchors import dist_to_box, grid_points
from yolokit.train import TrainConfig
from yolokit.train.build import build_loss
from yolokit.train.optim import build_optimizer
from yolokit.val.metrics import coco_evaluate


@dataclass
class Settings:
    """Sizes and repetitions of a benchmark run.

    Attributes:
        quick: a fast smoke run (fewer runs, smaller sets); its numbers are not for reporting.
        warmup: uncounted rounds before the counted ones.
        repeats: counted rounds (each side once per round).
        reference: the Ultralytics version when its side runs, else None.
    """

    quick: bool = False
    warmup: int = 2
    repeats: int = 7
    reference: str | None = None


@dataclass
class Row:
    """One timed comparison.

    Attributes:
        label: what is timed.
        ours: yolokit's callable (one run).
        theirs: the reference callable, or None.
        unit: "ms" (per call) or "img/s" (throughput; callables return ``Timed``).
        inner: calls per counted run.
        memory: also read the peak memory of one call of each side.
        notes: facts printed with the row (sizes, how the two sides differ).
    """

    label: str
    ours: Callable[[], Any]
    theirs: Callable[[], Any] | None = None
    unit: str = "ms"
    inner: int = 1
    memory: bool = False
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Case:
    name: str
    title: str
    build: Callable[[Settings], list[Row]]


def _ref():
    from harness import reference

    return reference


# ------------------------------------------------------------------ train step


def _our_train_step(name: str, images: Tensor, targets: Tensor, channels_last: bool | None = None,
                    optimizer: str = "sgd", masks: Tensor | None = None) -> Callable[[], None]:
    """The trainer's step: forward + loss, backward of loss * batch, clip at 10, SGD step, zero grad (no EMA).

    ``channels_last`` as ``TrainConfig.channels_last``: None is the trainer's default, on
    for the CPU (model and images NHWC). ``optimizer`` "musgd": the trainer's MuSGD at lr 0.01,
    momentum 0.9. ``masks``: a segmentation batch's index maps, given to the loss."""
    config = TrainConfig(channels_last=channels_last)
    model = yolokit.create_model(name, num_classes=80).train()
    if prefers_channels_last("cpu") if config.channels_last is None else config.channels_last:
        model.to(memory_format=torch.channels_last)
        images = images.contiguous(memory_format=torch.channels_last)
    criterion = build_loss(model, config)
    lr, momentum = (0.01, 0.9) if optimizer == "musgd" else (config.lr0, config.momentum)
    optimizer = build_optimizer(model, optimizer, lr, momentum, config.weight_decay)
    precision = Precision("fp32", "cpu")
    extra = {} if masks is None else {"masks": masks}

    def step() -> None:
        loss, _ = criterion(model(images), targets, **extra)
        precision.backward(loss * len(images))
        precision.step(optimizer, clip_grad_norm=10.0)
        optimizer.zero_grad(set_to_none=True)

    return step


def train_step(s: Settings) -> list[Row]:
    batch, size = (4, 256) if s.quick else (8, 320)
    images = inputs.random_images(batch, size)
    targets = inputs.random_targets(batch, 8, size, min_wh=8, max_wh=size // 2)
    rows = []
    for name in ("yolov8n", "yolov3-tiny"):
        notes = [f"batch {batch}, {size} px, fp32, 8 boxes per image; SGD (Nesterov, 3 parameter groups), "
                 "clip at norm 10, no EMA",
                 "each side's default layout: yolokit's trainer lays model and images out channels_last on the "
                 "CPU (TrainConfig.channels_last=None), the reference keeps NCHW"]
        theirs = None
        if s.reference:
            ref = _ref()
            theirs = ref.train_step(name, images, targets)
            ours_n = sum(p.numel() for p in yolokit.create_model(name).parameters())
            notes.append(f"parameters: yolokit {ours_n:,}, reference {ref.parameters(name):,}")
            if name in ref.NOTES:
                notes.append(ref.NOTES[name] + "; yolokit's is Darknet's anchor head with YOLOv3Loss")
            notes.append("the reference loss is multiplied by the batch size (irrelevant to timing)")
        rows.append(Row(name, _our_train_step(name, images, targets), theirs, memory=True, notes=notes))
    for channels_last, label in ((False, "NCHW"), (True, "channels_last")):
        theirs = _ref().train_step("yolov8n", images, targets, channels_last=channels_last) if s.reference else None
        rows.append(Row(f"yolov8n, {label} on both sides", _our_train_step("yolov8n", images, targets, channels_last),
                        theirs, notes=[f"yolokit: TrainConfig.channels_last={channels_last}; reference: its model "
                                       "and images in the same layout (its trainer has no such switch)"]))
    return rows


def yolo26(s: Settings) -> list[Row]:
    """YOLO26n: the train step against the reference's on the same batch, and inference against yolov8n's."""
    batch, size = (4, 256) if s.quick else (8, 320)
    images = inputs.random_images(batch, size)
    targets = inputs.random_targets(batch, 8, size, min_wh=8, max_wh=size // 2)
    rows = []
    for optimizer in ("sgd", "musgd"):
        theirs = _ref().train_step("yolo26n.yaml", images, targets, musgd=optimizer == "musgd") if s.reference else None
        notes = [f"batch {batch}, {size} px, fp32, 8 boxes per image; both branches and the two-branch loss "
                 "(reference: E2ELoss); clip at norm 10, no EMA; each side's default layout"]
        if optimizer == "musgd":
            notes.append("MuSGD lr 0.01, momentum 0.9, Muon 0.2 + SGD 1.0 on conv weights; yolokit's Newton-Schulz "
                         "in float32 on the CPU (ns_precision='auto'), the reference's in bfloat16")
        rows.append(Row(f"yolo26n train step, {optimizer}", _our_train_step("yolo26n.yaml", images, targets,
                                                                           optimizer=optimizer),
                        theirs, memory=True, notes=notes))
    size = 320 if s.quick else 640
    x = inputs.random_images(1, size)
    for name in ("yolov8n", "yolo26n.yaml"):
        model = yolokit.create_model(name, num_classes=80).eval().fuse()

        def ours(model=model) -> Tensor:
            with torch.inference_mode():
                maps = model(x)
                return model.decode(maps)

        theirs = _ref().inference(name, fuse=True) if s.reference else None
        rows.append(Row(f"{name.removesuffix('.yaml')} inference, batch 1, {size} px", ours,
                        (lambda theirs=theirs: theirs(x)) if theirs else None,
                        notes=["fused, fp32, inference_mode: forward + the one-to-many decode; yolokit's yolo26n "
                               "computes both branches (predict(nms=False) stays possible), the reference's fuse() "
                               "drops the one it does not use"]))
    return rows


# ------------------------------------------------------------------ inference


def inference(s: Settings) -> list[Row]:
    size = 320 if s.quick else 640
    x = inputs.random_images(1, size)
    rows = []
    cases = (("yolov8n unfused", False, None), ("yolov8n fused", True, None), ("yolov8n fused, NCHW", True, False))
    for label, fuse, channels_last in cases:
        model = yolokit.create_model("yolov8n", num_classes=80).eval()
        if fuse:
            model.fuse(channels_last=channels_last)

        def ours(model=model) -> Tensor:
            with torch.inference_mode():
                return model.decode(model(x))

        theirs = None
        if s.reference:
            forward = _ref().inference("yolov8n", fuse=fuse)
            theirs = lambda forward=forward: forward(x)  # noqa: E731
        notes = {
            "yolov8n unfused": [f"yolov8n, batch 1, {size} px, fp32, inference_mode; forward + box decode on both "
                                "sides (their eval forward decodes in the head)"],
            "yolov8n fused": ["fuse() on both sides; yolokit's also lays the weights out channels_last on the CPU "
                              "(its default there)"],
            "yolov8n fused, NCHW": ["yolokit: fuse(channels_last=False), the reference's layout"],
        }[label]
        rows.append(Row(label, ours, theirs, inner=5, memory=True, notes=notes))
    return rows


# ------------------------------------------------------------------ decode + NMS


def decode_nms(s: Settings) -> list[Row]:
    maps = inputs.detection_like_maps(640)
    model = yolokit.create_model("yolov8n", num_classes=80).eval()
    with torch.inference_mode():
        decoded = model.decode(maps)
    best = int((decoded[0, :, 4:].max(-1).values > 0.001).sum())
    rows = []
    for multi in (False, True):
        def ours(multi=multi) -> list[Detections]:
            with torch.inference_mode():
                return non_max_suppression(model.decode(maps), conf=0.001, iou=0.7, multi_label=multi)

        theirs = _ref().decode_nms(maps, conf=0.001, iou=0.7, multi_label=multi) if s.reference else None
        notes = [f"yolov8n raw maps at 640 (8400 points, {best} above conf), conf 0.001, iou 0.7, max_det 300; "
                 "both sides start from the same per-level maps"] if not multi else \
            ["multi_label: one candidate per (point, class) above conf, as validators use"]
        rows.append(Row(f"decode + NMS{' multi-label' if multi else ''}", ours, theirs, inner=5, notes=notes))
    return rows


# ------------------------------------------------------------------ assigner + loss


def loss(s: Settings) -> list[Row]:
    batch, size, per_image, c = (8, 320, 10, 80) if s.quick else (16, 640, 10, 80)
    targets = inputs.random_targets(batch, per_image, size, classes=c)
    maps = inputs.v8_maps(batch, size, classes=c)
    v8 = YOLOv8Loss(c, inputs.STRIDES)

    def ours() -> None:
        leaves = [m.detach().requires_grad_() for m in maps]
        total, _ = v8(leaves, targets)
        total.backward()

    # the assigner alone, on the decoded predictions the loss hands it
    shapes = [tuple(m.shape[-2:]) for m in maps]
    points, point_strides = grid_points(shapes, inputs.STRIDES)
    flat = torch.cat([m.flatten(2) for m in maps], 2).transpose(1, 2)
    dist = flat[..., :64].reshape(batch, -1, 4, 16).softmax(-1) @ torch.arange(16.0)
    boxes = dist_to_box(dist * point_strides[:, None], points)
    scores = flat[..., 64:].sigmoid().contiguous()
    gt = pad_targets(targets, batch)
    assigner = TaskAlignedAssigner()

    v3_anchors = ((10, 13), (16, 30), (33, 23)), ((30, 61), (62, 45), (59, 119)), ((116, 90), (156, 198), (373, 326))
    v3_maps = [m * 0.5 for m in inputs.v8_maps(batch, size, classes=3 * (5 + c) - 64, seed=1)]
    v3 = YOLOv3Loss(c, v3_anchors, inputs.STRIDES)

    def ours_v3() -> None:
        leaves = [m.detach().requires_grad_() for m in v3_maps]
        total, _ = v3(leaves, targets)
        total.backward()

    theirs = theirs_tal = None
    if s.reference:
        ref = _ref()
        theirs = ref.loss(maps, targets, size)
        theirs_tal = ref.assigner(scores, boxes, points, gt.labels, gt.boxes, gt.mask)
    setting = f"batch {batch}, {size} px, {per_image} boxes per image, {c} classes, P={len(points)}"
    return [
        Row("YOLOv8 loss forward + backward", ours, theirs, notes=[
            setting + "; from the same per-level maps to their gradients (the reference's level "
            "concatenation, done in its head, is included)"]),
        Row("TaskAlignedAssigner (our assign_rows, their forward)",
            lambda: assigner.assign_rows(scores, boxes, points, *gt.rows(), per_image=gt.labels.shape[1]), theirs_tal),
        Row("YOLOv3 loss forward + backward (no reference)", ours_v3, None),
    ]


# ------------------------------------------------------------------ data pipeline


def data_pipeline(s: Settings) -> list[Row]:
    from harness import pipeline

    batch, workers = 16, 2
    imgsz, count, warmup = (320, 6, 2) if s.quick else (640, 24, 4)
    yaml = pipeline.dataset_yaml(images=(count + warmup) * batch, imgsz=imgsz)
    ours, _ = pipeline.yolokit_loader(yaml, imgsz=imgsz, batch=batch, workers=workers, uint8=True)
    ours_float, _ = pipeline.yolokit_loader(yaml, imgsz=imgsz, batch=batch, workers=workers, uint8=False)
    theirs = None
    if s.reference:
        theirs, _ = _ref().data_loader(yaml, imgsz=imgsz, batch=batch, workers=workers)
    notes = [f"shapes set at {imgsz} px ({(count + warmup) * batch} images), batch {batch}, {workers} workers, "
             f"Mosaic on, YOLOv8 default augmentation; {count} batches counted after {warmup}, fresh workers per run",
             "uint8 batches (what the trainer uses; the reference's are uint8 too); ratio = time per image",
             "the reference also applies its default albumentations (blur, median blur, gray, CLAHE at p=0.01 each) "
             "and prefetches 4 batches per worker (yolokit 2)"]

    def timed(run: Callable[[int, int], Timed]) -> Callable[[], Timed]:
        return lambda: run(count, warmup)

    return [
        Row("loader (uint8 batches)", timed(ours), timed(theirs) if theirs else None, unit="img/s", notes=notes),
        Row("loader (float batches, no reference)", timed(ours_float), None, unit="img/s"),
    ]


# ------------------------------------------------------------------ evaluation


def evaluation(s: Settings) -> list[Row]:
    n = 100 if s.quick else 500
    data = inputs.evaluation_set(n)
    preds = [Detections(torch.from_numpy(d["boxes"]), torch.from_numpy(d["scores"]), torch.from_numpy(d["labels"]))
             for d in data]
    targets = [(d["gt_boxes"], d["gt_labels"]) for d in data]
    shapes = [d["shape"] for d in data]

    def ours() -> float:
        return coco_evaluate(preds, targets, shapes, 80).map50_95

    def pycocotools() -> float:
        return coco_evaluate(preds, targets, shapes, 80, backend="pycocotools").map50_95

    notes = [f"{n} images, {sum(len(d['gt_labels']) for d in data)} GT boxes, "
             f"{sum(len(d['labels']) for d in data)} detections, 80 classes; predictions to mAP50-95",
             f"yolokit: COCOeval's algorithm on arrays (yolokit.val.cocoeval; all 12 COCO numbers, equal to "
             f"pycocotools'), mAP50-95 {ours():.4f} (pycocotools {pycocotools():.4f})"]
    theirs = None
    if s.reference:
        theirs = _ref().evaluate(data, 80)
        notes.append(f"reference: box IoU + match_predictions + DetMetrics (ap_per_class), mAP50-95 {theirs():.4f}")
    return [Row("predictions to mAP", ours, theirs, notes=notes),
            Row("pycocotools COCOeval (no reference)", pycocotools, None, notes=[])]


def _segment(s: Settings) -> list[Row]:
    from harness.seg_cases import segment

    return segment(s, _our_train_step)


CASES: dict[str, Case] = {c.name: c for c in (
    Case("train", "train step: forward + loss + backward + optimizer step", train_step),
    Case("yolo26", "YOLO26n: train step (SGD, MuSGD) and inference against yolov8n", yolo26),
    Case("inference", "inference forward at 640, batch 1", inference),
    Case("nms", "decode + NMS on a yolov8n output", decode_nms),
    Case("loss", "assigner + loss alone", loss),
    Case("data", "training data pipeline, images per second", data_pipeline),
    Case("eval", "evaluation of a validation set", evaluation),
    Case("seg", "yolov8n-seg: train step, mask loss (time and peak memory), masks in the loader", _segment),
)}
