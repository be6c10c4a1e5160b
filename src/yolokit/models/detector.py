"""``Detector``: backbone -> neck -> head, with decode, predict, fuse and summary."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from yolokit.models.layers import Conv
from yolokit.models.necks import neck_units
from yolokit.ops.geometry import unletterbox_boxes
from yolokit.ops.masks import mask_crops_in_original, masks_in_original, point_coefficients
from yolokit.ops.nms import (
    Detections,
    end_to_end_detections,
    end_to_end_points,
    nms_points,
    non_max_suppression,
)


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


def prefers_channels_last(device_type: str) -> bool:
    """The default memory layout for training and inference on a device type (the one rule).

    On for the CPU, where oneDNN's NHWC kernels make a yolov8n forward 25-30% faster and a
    training step 10-20% faster, and for CUDA, where cuDNN's NHWC tensor-core kernels made every
    case measured faster (an H200, BENCHMARKS.md "GPU": training in bf16 yolov8n 2.54x, yolov8s
    2.09x, yolov8l 1.74x, yolov3 2.02x; in fp16 yolov8n 1.61x, yolov8s 1.79x; inference in bf16
    yolov8n 1.26x, yolov8s 1.29x; the first H100 pass: yolov8l bf16 1.64x). Off elsewhere until measured.
    """
    return device_type in ("cpu", "cuda")


class Detector(nn.Module):
    """An object detector: ``head(neck(backbone(images)))``.

    ``forward`` returns the head's raw per-level maps in train and eval mode alike (an end-to-end
    head's: the dict ``{"one2many": maps, "one2one": maps}``); ``decode`` turns them into boxes and
    scores; ``predict`` runs the whole inference path from images of any size to per-image
    ``Detections`` in original pixels.

    Args:
        backbone: exposes ``out_channels`` and ``strides``.
        neck: maps backbone features to the head's inputs.
        head: exposes ``num_classes``, ``strides`` and ``decode``.
        config: the variant's config dataclass (kept for checkpoints).
        name: variant name used in summaries.
        names: class names by index (weights files that store them set this on load).
    """

    def __init__(self, backbone: nn.Module, neck: nn.Module, head: nn.Module, *, config: Any = None,
                 name: str = "detector", names: Sequence[str] | None = None):
        super().__init__()
        self.backbone, self.neck, self.head = backbone, neck, head
        self.config, self.name = config, name
        self.names = names

    @property
    def names(self) -> list[str]:
        """Class names by index: those a weights file stored, else ``"0"``, ``"1"``, ..."""
        return list(self._names) if self._names else [str(i) for i in range(self.num_classes)]

    @names.setter
    def names(self, names: Sequence[str] | dict[int, str] | None) -> None:
        if isinstance(names, dict):
            names = [str(names.get(i, i)) for i in range(self.num_classes)]
        if names is not None and len(names) != self.num_classes:
            raise ValueError(f"{self.name} has {self.num_classes} classes but {len(names)} names were given")
        self._names = None if names is None else [str(n) for n in names]

    @property
    def has_names(self) -> bool:
        """Whether real class names were attached (by a weights file or the user)."""
        return bool(self._names)

    @property
    def num_classes(self) -> int:
        return self.head.num_classes

    @property
    def strides(self) -> tuple[int, ...]:
        return self.head.strides

    @property
    def end_to_end(self) -> bool:
        """Whether the head has a one-to-one branch (YOLO26), whose detections need no NMS."""
        return bool(getattr(self.head, "end_to_end", False))

    def forward(self, images: Tensor) -> list[Tensor] | dict[str, list[Tensor]]:
        """Tensor[B, 3, H, W] (H, W multiples of the largest stride) -> list of raw maps (an end-to-end
        head: a dict of two such lists)."""
        stride = max(self.strides)
        if images.ndim != 4 or images.shape[-2] % stride or images.shape[-1] % stride:
            raise ValueError(f"{self.name} needs Tensor[B, 3, H, W] with H and W multiples of {stride}, "
                             f"got shape {tuple(images.shape)}")
        return self.head(self.neck(self.backbone(images)))

    def decode(self, maps: list[Tensor] | dict[str, list[Tensor]], *, nms: bool = True) -> Tensor:
        """Raw maps -> Tensor[B, P, 4 + C]: xyxy boxes in input pixels, class scores in [0, 1].

        Args:
            maps: ``forward``'s output.
            nms: the predictions that NMS selects from (an end-to-end head's one-to-many branch);
                False: an end-to-end head's one-to-one branch, for ``ops.nms.end_to_end_detections``.
        """
        self.check_nms(nms)
        if self.end_to_end:
            return self.head.decode(maps, branch="one2many" if nms else "one2one")
        return self.head.decode(maps)

    def check_nms(self, nms: bool) -> None:
        """Raises a ValueError for ``nms=False`` on a model without a one-to-one branch."""
        if not nms and not self.end_to_end:
            raise ValueError(f"{self.name} has no one-to-one (end-to-end) branch: its detections need NMS "
                             "(nms=False needs a model such as yolo26)")

    @torch.inference_mode()
    def predict(
        self,
        images: Tensor,
        *,
        conf: float = 0.25,
        iou: float = 0.7,
        max_det: int = 300,
        classes: Sequence[int] | None = None,
        agnostic: bool = False,
        multi_label: bool = False,
        orig_shapes: Sequence[tuple[int, int]] | None = None,
        ratio_pad: Sequence[Any] | None = None,
        nms: bool = True,
        mask_form: str = "whole",
    ) -> list[Detections]:
        """Detects objects in a batch of input tensors: forward, decode, NMS, boxes mapped back.

        The tensors are the network's input as they are: nothing is resized here. Files,
        folders, videos, streams and numpy or PIL images go through ``yolokit.predict``
        (``predict(model, source, imgsz=640)``), which decodes, letterboxes and batches them
        with constant memory and then calls this method.

        Args:
            images: Tensor[B, 3, H, W] or Tensor[3, H, W], RGB, uint8 or float in [0, 1],
                on any device. Sides that are not a multiple of the largest stride are
                padded with grey at the right and bottom (boxes are unaffected).
            conf: score threshold.
            iou: NMS IoU threshold.
            max_det: most detections per image.
            classes: keep only these classes.
            agnostic: class-agnostic NMS.
            multi_label: a box may be kept once per class scoring above ``conf`` (the
                validation protocol); otherwise only its best class.
            orig_shapes: (h, w) of each original image, to map boxes back to its pixels;
                None keeps them in input pixels.
            ratio_pad: per image ((ratio_w, ratio_h), (pad_w, pad_h)) of the letterbox that
                made the input; None with ``orig_shapes`` means a plain resize.
            nms: True: the one-to-many predictions through NMS (every model; YOLO26's default, as
                the reference's). False: an end-to-end model's (YOLO26's) one-to-one branch, its
                ``max_det`` best (point, class) pairs above ``conf``, without NMS (``iou`` and
                ``multi_label`` do not apply; ``agnostic``: one class per point). A model without
                that branch raises a ValueError.
            mask_form: a segmentation model's masks: "whole", Tensor[K, H, W] bool in each image's pixels;
                or "crops", ``ops.masks.MaskCrops`` (each mask inside its box only: memory the boxes' areas,
                what validation uses).

        Returns:
            One ``Detections`` per image, on the model's device.

        Examples:
            >>> model = yolokit.create_model("yolov8n", num_classes=3)
            >>> (det,) = model.predict(torch.zeros(3, 48, 64), conf=0.0, max_det=5)
            >>> det.boxes.shape
            torch.Size([5, 4])
        """
        self.check_nms(nms)
        if mask_form not in ("whole", "crops"):
            raise ValueError(f"mask_form must be 'whole' or 'crops', got {mask_form!r}")
        param = next(self.parameters())
        batch, orig_shapes, ratio_pad = input_batch(images, int(max(self.strides)), param.device, param.dtype,
                                                    orig_shapes, ratio_pad)
        was_training = self.training
        self.eval()
        try:
            maps = self(batch)
            preds = self.decode(maps) if nms else self.decode(maps, nms=False)
        finally:
            self.train(was_training)
        seg = None
        if getattr(self.head, "segments", False):   # each point's coefficients, the prototypes, the input's size
            seg = (point_coefficients(maps["coefficients" if nms else "one2one_coefficients"]), maps["protos"],
                   tuple(batch.shape[-2:]))
        return detections_of(preds, orig_shapes, ratio_pad, nms=nms, conf=conf, iou=iou, max_det=max_det,
                             classes=classes, agnostic=agnostic, multi_label=multi_label, seg=seg,
                             mask_form=mask_form)

    def fuse(self, channels_last: bool | None = None) -> Detector:
        """Prepares the model for inference: folds every batch norm into its convolution.

        Args:
            channels_last: also lay the 4-d weights out channels_last (NHWC), so that
                convolutions run in that layout whatever the input's. None (default):
                ``prefers_channels_last`` of the weights' device.

        Outputs equal the unfused model's up to float rounding. Returns ``self``.
        """
        for module in self.modules():
            if isinstance(module, Conv):
                module.fuse()
        if channels_last is None:
            channels_last = prefers_channels_last(next(self.parameters()).device.type)
        if channels_last:
            self.to(memory_format=torch.channels_last)
        return self

    def checkpoint_units(self, which: str = "all") -> list[tuple[str, nn.Module]]:
        """Named blocks worth activation checkpointing: "backbone" stages, "neck" blocks, or "all".

        A part that has its own ``checkpoint_units()`` (a model YAML's layer graphs: every layer with
        parameters; a timm backbone: its stages) names them; otherwise the built-in backbones'
        ``stages`` and the necks' convolution blocks.
        """
        if which not in ("all", "backbone", "neck"):
            raise ValueError(f"which must be 'all', 'backbone' or 'neck', got {which!r}")
        units = []
        if which in ("all", "backbone"):
            own = getattr(self.backbone, "checkpoint_units", None)
            found = own() if own is not None else [(f"stages.{i}", m) for i, m in enumerate(self.backbone.stages)]
            units += [(f"backbone.{name}", m) for name, m in found]
        if which in ("all", "neck"):
            own = getattr(self.neck, "checkpoint_units", None)
            units += [(f"neck.{name}", m) for name, m in (own() if own is not None else neck_units(self.neck))]
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


def input_batch(images: Tensor, stride: int, device: torch.device | str, dtype: torch.dtype,
                orig_shapes: Sequence[tuple[int, int]] | None = None, ratio_pad: Sequence[Any] | None = None,
                ) -> tuple[Tensor, list[tuple[int, int]], list[Any]]:
    """``Detector.predict``'s input as the network takes it, and where each image's boxes map back to.

    Args:
        images: Tensor[B, 3, H, W] or Tensor[3, H, W], RGB, uint8 or float in [0, 1].
        stride: sides are padded with grey at the right and bottom to multiples of this.
        device, dtype: of the returned batch.
        orig_shapes, ratio_pad: as ``Detector.predict`` takes them.

    Returns:
        ``(batch, orig_shapes, ratio_pad)``: a float batch in [0, 1], and one shape and one
        ``((ratio_w, ratio_h), (pad_w, pad_h))`` per image (input pixels when none were given).
    """
    if not isinstance(images, Tensor):
        raise TypeError(f"Detector.predict takes Tensor[B, 3, H, W] or Tensor[3, H, W], got "
                        f"{type(images).__name__}: files, folders, videos and numpy or PIL images go through "
                        "yolokit.predict(model, source)")
    batch = images[None] if images.ndim == 3 else images
    if batch.ndim != 4 or batch.shape[1] != 3:
        raise ValueError(f"images must be Tensor[B, 3, H, W] or Tensor[3, H, W], got shape {tuple(images.shape)}")
    h, w = batch.shape[-2:]
    if orig_shapes is None:
        orig_shapes, ratio_pad = [(h, w)] * len(batch), None
    if ratio_pad is None:
        ratio_pad = [((w / ow, h / oh), (0.0, 0.0)) for oh, ow in orig_shapes]
    uint8 = not batch.is_floating_point()
    batch = batch.to(device, dtype)
    if uint8:
        batch = batch / 255
    if h % stride or w % stride:
        batch = F.pad(batch, (0, -w % stride, 0, -h % stride), value=114 / 255)
    return batch, list(orig_shapes), list(ratio_pad)


def detections_of(predictions: Tensor, orig_shapes: Sequence[tuple[int, int]], ratio_pad: Sequence[Any], *,
                  nms: bool = True, conf: float = 0.25, iou: float = 0.7, max_det: int = 300,
                  classes: Sequence[int] | None = None, agnostic: bool = False,
                  multi_label: bool = False, seg: tuple[Tensor, Tensor, tuple[int, int]] | None = None,
                  mask_form: str = "whole") -> list[Detections]:
    """Decoded predictions Tensor[B, P, 4 + C] -> ``Detector.predict``'s detections: NMS (or, with
    ``nms=False``, an end-to-end branch's top-k), boxes mapped back to each original image.

    ``seg``: a segmentation head's ``(coefficients Tensor[B, P, M], prototypes Tensor[B, M, h, w], the input's
    (height, width))``: each detection also gets its mask in its original image (``ops.masks.masks_in_original``;
    with ``mask_form="crops"`` as ``ops.masks.MaskCrops``).
    """
    if seg is None:
        if nms:
            dets = non_max_suppression(predictions, conf=conf, iou=iou, classes=classes, agnostic=agnostic,
                                       multi_label=multi_label, max_det=max_det)
        else:
            dets = end_to_end_detections(predictions, conf=conf, classes=classes, max_det=max_det,
                                         agnostic=agnostic)
        return mapped_back(dets, orig_shapes, ratio_pad)
    found = (nms_points(predictions, conf=conf, iou=iou, classes=classes, agnostic=agnostic,
                        multi_label=multi_label, max_det=max_det) if nms else
             end_to_end_points(predictions, conf=conf, classes=classes, max_det=max_det, agnostic=agnostic))
    dets = mapped_back([d for d, _ in found], orig_shapes, ratio_pad)
    return with_masks(dets, [point for _, point in found], seg, orig_shapes, ratio_pad, mask_form=mask_form)


def with_masks(dets: Sequence[Detections], points: Sequence[Tensor], seg: tuple[Tensor, Tensor, tuple[int, int]],
               orig_shapes: Sequence[tuple[int, int]], ratio_pad: Sequence[Any], *,
               mask_form: str = "whole") -> list[Detections]:
    """Each image's detections (boxes in original pixels) with their masks: those of the points (Tensor[K]
    indices into ``seg``'s coefficients) they came from, sampled into the original image
    (``ops.masks.masks_in_original``, or with ``mask_form="crops"`` ``mask_crops_in_original``). ``seg``: as
    ``detections_of``'s."""
    coefficients, protos, size = seg
    sample = mask_crops_in_original if mask_form == "crops" else masks_in_original
    return [Detections(d.boxes, d.scores, d.labels, sample(coefficients[b, point], protos[b], d.boxes, rp, size, shape))
            for b, (d, point, rp, shape) in enumerate(zip(dets, points, ratio_pad, orig_shapes, strict=True))]


def mapped_back(dets: Sequence[Detections], orig_shapes: Sequence[tuple[int, int]],
                ratio_pad: Sequence[Any]) -> list[Detections]:
    """Each image's detections with boxes in its original pixels (``ops.geometry.unletterbox_boxes``)."""
    return [Detections(unletterbox_boxes(d.boxes, rp, shape), d.scores, d.labels)
            for d, rp, shape in zip(dets, ratio_pad, orig_shapes, strict=True)]
