"""The segmentation case: yolov8n-seg's training step, the mask loss alone (time and peak memory) and the
loader with masks, each against the reference's and against yolokit's box-only counterpart."""

from __future__ import annotations

from collections.abc import Callable

import torch

from harness import inputs
from harness.cases import Row, Settings, _ref
from harness.pipeline import yolokit_loader
from yolokit.data import make_shapes
from yolokit.losses import YOLOv8SegLoss


def segment(s: Settings, our_train_step: Callable[..., Callable[[], None]]) -> list[Row]:
    return [*_train_steps(s, our_train_step), _mask_loss(s), *_loaders(s)]


def _train_steps(s: Settings, our_train_step: Callable[..., Callable[[], None]]) -> list[Row]:
    batch, size = (4, 256) if s.quick else (8, 320)
    images = inputs.random_images(batch, size)
    targets = inputs.random_targets(batch, 8, size, min_wh=8, max_wh=size // 2)
    masks = inputs.box_masks(targets, batch, size)
    rows = []
    for channels_last, label in ((None, "each side's default layout"), (False, "NCHW on both sides")):
        theirs = _ref().train_step("yolov8n-seg", images, targets, masks=masks) if s.reference else None
        notes = [f"batch {batch}, {size} px, fp32, 8 boxes per image, their masks as one index map per image "
                 "(overlap_mask, both sides' default) at a quarter of the input; SGD, clip at norm 10, no EMA"]
        if channels_last is None:
            notes.append("yolokit lays model and images out channels_last on the CPU (its trainer's default), the "
                         "reference keeps NCHW")
        rows.append(Row(f"yolov8n-seg train step, {label}",
                        our_train_step("yolov8n-seg", images, targets, channels_last, masks=masks), theirs,
                        memory=channels_last is None, notes=notes))
    det = our_train_step("yolov8n", images, targets, None)
    rows.append(Row("yolov8n train step (no masks, no reference): the detection step on the same batch", det,
                    None, notes=["what the mask branch and term add: this row against the first"]))
    return rows


def _mask_loss(s: Settings) -> Row:
    """The seg loss at 16 images x 100 objects at 640 px (8 x 30 at 320 when quick): time and peak memory."""
    batch, size, per_image, c = (8, 320, 30, 80) if s.quick else (16, 640, 100, 80)
    targets = inputs.random_targets(batch, per_image, size, classes=c, min_wh=8, max_wh=size // 3)
    masks = inputs.box_masks(targets, batch, size)
    maps = inputs.v8_maps(batch, size, classes=c)
    gen = torch.Generator().manual_seed(1)
    coefficients = [torch.randn(batch, 32, *m.shape[-2:], generator=gen) for m in maps]
    protos = torch.randn(batch, 32, size // 4, size // 4, generator=gen)
    loss = YOLOv8SegLoss(c, inputs.STRIDES)

    def ours() -> None:
        out = {"maps": [m.detach().requires_grad_() for m in maps],
               "coefficients": [x.detach().requires_grad_() for x in coefficients],
               "protos": protos.detach().requires_grad_()}
        total, _ = loss(out, targets, masks=masks)
        total.backward()

    theirs = _ref().seg_loss(maps, coefficients, protos, targets, masks, size) if s.reference else None
    return Row(f"seg loss forward + backward, {batch} x {per_image} at {size}", ours, theirs, memory=True,
               notes=[f"batch {batch}, {size} px, {per_image} objects per image, {c} classes, 32 prototypes at "
                      f"{size // 4} px, one index map per image; from the same maps, coefficients and prototypes "
                      "to their gradients; peak memory: the dense per-positive masks each side builds"])


def _loaders(s: Settings) -> list[Row]:
    batch, workers = 16, 2
    imgsz, count, warmup = (256, 4, 1) if s.quick else (640, 16, 3)
    yaml = make_shapes(n_train=(count + warmup) * batch, n_val=16, imgsz=imgsz, seed=0, segments=True)
    rows = []
    for masks in (True, False):
        ours, _ = yolokit_loader(yaml, imgsz=imgsz, batch=batch, workers=workers, segments=masks)
        theirs = None
        if s.reference:
            theirs, _ = _ref().data_loader(yaml, imgsz=imgsz, batch=batch, workers=workers,
                                           task="segment" if masks else "detect")
        label = "loader with masks (polygons warped, masks drawn)" if masks else "loader, boxes only (same set)"
        notes = [f"shapes-seg at {imgsz} px ({(count + warmup) * batch} images), batch {batch}, {workers} workers, "
                 f"Mosaic on; {count} batches counted after {warmup}, fresh workers per run; ratio = time per "
                 "image; rasterizing's cost: this row's yolokit time against the next's"] if masks else []
        rows.append(Row(label, lambda run=ours: run(count, warmup),
                        (lambda run=theirs: run(count, warmup)) if theirs else None, unit="img/s", notes=notes))
    return rows
