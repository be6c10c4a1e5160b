"""``Detector``: backbone -> neck -> head, with decode, predict, fuse and summary."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from yolokit.models.layers import Conv
from yolokit.models.necks import neck_units
from yolokit.ops.boxes import unletterbox_boxes
from yolokit.ops.images import letterbox, load_images
from yolokit.ops.nms import Detections, non_max_suppression


@dataclass(frozen=True)
class ModelSummary:
    """Size of a model: leaf layers, parameters (all, trainable) and GFLOPs at ``imgsz``."""

    name: str
    layers: int
    parameters: int
    trainable: int
    gflops: float
    imgsz: int

    def __str__(self) -> str:
        return (f"{self.name} summary: {self.layers} layers, {self.parameters:,} parameters, "
                f"{self.trainable:,} trainable, {self.gflops:.1f} GFLOPs at {self.imgsz}x{self.imgsz}")


class Detector(nn.Module):
    """An object detector: ``head(neck(backbone(images)))``.

    ``forward`` returns the head's raw per-level maps in train and eval mode alike;
    ``decode`` turns them into boxes and scores; ``predict`` runs the whole inference
    path from images of any size to per-image ``Detections`` in original pixels.

    Args:
        backbone: exposes ``out_channels`` and ``strides``.
        neck: maps backbone features to the head's inputs.
        head: exposes ``num_classes``, ``strides`` and ``decode``.
        config: the variant's config dataclass (kept for checkpoints).
        name: variant name used in summaries.
    """

    def __init__(self, backbone: nn.Module, neck: nn.Module, head: nn.Module, *, config: Any = None,
                 name: str = "detector"):
        super().__init__()
        self.backbone, self.neck, self.head = backbone, neck, head
        self.config, self.name = config, name

    @property
    def num_classes(self) -> int:
        return self.head.num_classes

    @property
    def strides(self) -> tuple[int, ...]:
        return self.head.strides

    def forward(self, images: Tensor) -> list[Tensor]:
        """Tensor[B, 3, H, W] (H, W multiples of the largest stride) -> list of raw maps."""
        stride = max(self.strides)
        if images.ndim != 4 or images.shape[-2] % stride or images.shape[-1] % stride:
            raise ValueError(f"{self.name} needs Tensor[B, 3, H, W] with H and W multiples of {stride}, "
                             f"got shape {tuple(images.shape)}")
        return self.head(self.neck(self.backbone(images)))

    def decode(self, maps: list[Tensor]) -> Tensor:
        """Raw maps -> Tensor[B, P, 4 + C]: xyxy boxes in input pixels, class scores in [0, 1]."""
        return self.head.decode(maps)

    @torch.inference_mode()
    def predict(
        self,
        source: Any,
        *,
        conf: float = 0.25,
        iou: float = 0.7,
        max_det: int = 300,
        imgsz: int = 640,
        classes: Sequence[int] | None = None,
        agnostic: bool = False,
        orig_shapes: Sequence[tuple[int, int]] | None = None,
        ratio_pad: Sequence[Any] | None = None,
    ) -> list[Detections]:
        """Detects objects in images; boxes come back in original image pixels.

        Args:
            source: a file or folder path, a numpy HWC uint8 RGB image, a PIL image, a
                Tensor[3, H, W] (uint8, or float in [0, 1]), a list of these, or a
                Tensor[B, 3, H, W] float batch. With ``orig_shapes`` a batch is taken as
                already letterboxed (a data loader batch) and only mapped back.
            conf: score threshold.
            iou: NMS IoU threshold.
            max_det: most detections per image.
            imgsz: inference size (rounded up to a stride multiple); images keep their
                aspect ratio and are padded with grey.
            classes: keep only these classes.
            agnostic: class-agnostic NMS.
            orig_shapes: (h, w) per image of a ready batch.
            ratio_pad: per image ((ratio_w, ratio_h), (pad_w, pad_h)) of a ready batch;
                without it the batch is taken as a plain resize of the originals.

        Returns:
            One ``Detections`` per image.
        """
        if isinstance(source, Tensor) and source.ndim == 4 and orig_shapes is not None:
            batch = source
            if ratio_pad is None:
                h, w = batch.shape[-2:]
                ratio_pad = [((w / ow, h / oh), (0.0, 0.0)) for oh, ow in orig_shapes]
        else:
            batch, orig_shapes, ratio_pad = self._letterbox_batch(source, imgsz)
        param = next(self.parameters())
        was_training = self.training
        self.eval()
        try:
            preds = self.decode(self(batch.to(param.device, param.dtype)))
        finally:
            self.train(was_training)
        dets = non_max_suppression(preds, conf=conf, iou=iou, classes=classes, agnostic=agnostic, max_det=max_det)
        return [Detections(unletterbox_boxes(d.boxes, rp, shape), d.scores, d.labels)
                for d, rp, shape in zip(dets, ratio_pad, orig_shapes)]

    def _letterbox_batch(self, source: Any, imgsz: int) -> tuple[Tensor, list, list]:
        """Loads and letterboxes images into one batch; same-shape images get the smaller rectangle."""
        stride = max(self.strides)
        size = math.ceil(imgsz / stride) * stride
        images, _ = load_images(source)
        same = len({tuple(im.shape[-2:]) for im in images}) == 1
        boxed = [letterbox(im, (size, size), stride=stride, auto=same) for im in images]
        batch = torch.stack([b for b, _ in boxed])
        return batch, [tuple(im.shape[-2:]) for im in images], [rp for _, rp in boxed]

    def fuse(self, channels_last: bool | None = None) -> Detector:
        """Prepares the model for inference: folds every batch norm into its convolution.

        Args:
            channels_last: also lay the 4-d weights out channels_last (NHWC), so that
                convolutions run in that layout whatever the input's. None (default): when
                the weights are on the CPU, where oneDNN's NHWC kernels make a yolov8n
                forward 25-30% faster here; other devices keep their layout.

        Outputs equal the unfused model's up to float rounding. Returns ``self``.
        """
        for module in self.modules():
            if isinstance(module, Conv):
                module.fuse()
        if channels_last is None:
            channels_last = next(self.parameters()).device.type == "cpu"
        if channels_last:
            self.to(memory_format=torch.channels_last)
        return self

    def checkpoint_units(self, which: str = "all") -> list[tuple[str, nn.Module]]:
        """Named blocks worth activation checkpointing: "backbone" stages, "neck" blocks, or "all"."""
        if which not in ("all", "backbone", "neck"):
            raise ValueError(f"which must be 'all', 'backbone' or 'neck', got {which!r}")
        units = []
        if which in ("all", "backbone"):
            units += [(f"backbone.stages.{i}", m) for i, m in enumerate(self.backbone.stages)]
        if which in ("all", "neck"):
            units += [(f"neck.{name}", m) for name, m in neck_units(self.neck)]
        return units

    def summary(self, imgsz: int = 640) -> ModelSummary:
        """Layers, parameters and GFLOPs of one forward at ``imgsz`` (torch.utils.flop_counter)."""
        param = next(self.parameters())
        x = torch.zeros(1, 3, imgsz, imgsz, device=param.device, dtype=param.dtype)
        was_training = self.training
        self.eval()
        try:
            with torch.no_grad(), FlopCounterMode(display=False) as counter:
                self(x)
        finally:
            self.train(was_training)
        return ModelSummary(
            name=self.name,
            layers=sum(1 for m in self.modules() if not list(m.children())),
            parameters=sum(p.numel() for p in self.parameters()),
            trainable=sum(p.numel() for p in self.parameters() if p.requires_grad),
            gflops=counter.get_total_flops() / 1e9,
            imgsz=imgsz,
        )
