"""The reference side of each case: Ultralytics, called through its public modules.

Ultralytics is imported only inside these functions, and only when a benchmark runs
its reference side (the optional extra ``yolokit[bench]``, best installed in its own
environment: it is AGPL-licensed and no part of yolokit, which never imports this
harness). Nothing of it is copied here: its classes and functions are called as a user
would call them.
"""

from __future__ import annotations

import importlib.util
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from harness.timing import Timed
from yolokit.train.optim import parameter_groups

# yolokit variant -> Ultralytics model yaml. Their yolov3-tiny is the anchor-free "u"
# variant (YOLOv8 head and loss on the tiny backbone), not Darknet's anchor head.
YAMLS = {"yolov8n": "yolov8n.yaml", "yolov8s": "yolov8s.yaml", "yolov8m": "yolov8m.yaml",
         "yolov3": "yolov3u.yaml", "yolov3-tiny": "yolov3-tinyu.yaml", "yolo26n.yaml": "yolo26n.yaml",
         "yolov8n-seg": "yolov8n-seg.yaml", "yolov8s-seg": "yolov8s-seg.yaml"}
NOTES = {"yolov3": "reference is yolov3u (anchor-free YOLOv8 head and loss)",
         "yolov3-tiny": "reference is yolov3-tinyu (anchor-free YOLOv8 head and loss)"}


def version() -> str | None:
    """The installed Ultralytics version, or None when it cannot be imported."""
    if importlib.util.find_spec("ultralytics") is None:
        return None
    try:
        import ultralytics
    except Exception:  # a broken install counts as absent
        return None
    return str(ultralytics.__version__)


def model(name: str, *, num_classes: int = 80) -> nn.Module:
    """Their ``DetectionModel`` (``SegmentationModel`` for a ``-seg`` name) for a yolokit variant name, freshly
    initialised, with the default hyperparameters."""
    from ultralytics.cfg import get_cfg
    from ultralytics.nn.tasks import DetectionModel, SegmentationModel

    kind = SegmentationModel if name.endswith("-seg") else DetectionModel
    m = kind(YAMLS[name], nc=num_classes, verbose=False)
    m.args = get_cfg()  # their trainer attaches the run's hyperparameters (loss gains) like this
    return m


def batch_of(images: Tensor, targets: Tensor) -> dict[str, Tensor]:
    """Their training batch from ours: normalized cxcywh boxes, ``batch_idx`` and ``cls``."""
    h, w = images.shape[-2:]
    xyxy = targets[:, 2:6]
    cxcywh = torch.cat([(xyxy[:, :2] + xyxy[:, 2:]) / 2, xyxy[:, 2:] - xyxy[:, :2]], 1)
    scale = torch.tensor([w, h, w, h], dtype=cxcywh.dtype)
    return {"img": images, "batch_idx": targets[:, 0].clone(), "cls": targets[:, 1:2].clone(),
            "bboxes": cxcywh / scale}


def train_step(name: str, images: Tensor, targets: Tensor, device: torch.device | str = "cpu", *,
               dtype: torch.dtype | None = None, channels_last: bool = False, musgd: bool = False,
               masks: Tensor | None = None) -> Callable[[], Any]:
    """One step of their trainer: forward + loss (under autocast to ``dtype`` when given),
    backward (loss-scaled for float16, as their AMP does), unscale, clip at 10, SGD step
    (``musgd``: their MuSGD, Muon at 0.2 and SGD at 1.0 on conv and linear weights, SGD on the
    rest, as their trainer builds it), zero grad (no EMA). ``masks``: a segmentation batch's index
    maps (their ``overlap_mask`` form, as ours)."""
    device = torch.device(device)
    m = model(name).to(device).train()
    batch = {k: v.to(device) for k, v in batch_of(images, targets).items()}
    if masks is not None:
        batch["masks"] = masks.to(device)
    if channels_last:
        m = m.to(memory_format=torch.channels_last)
        batch["img"] = batch["img"].contiguous(memory_format=torch.channels_last)
    if musgd:
        from ultralytics.optim import MuSGD

        matrices = [p for p in m.parameters() if p.ndim in (2, 4)]
        rest = [p for p in m.parameters() if p.ndim not in (2, 4)]
        optimizer = MuSGD([{"params": matrices, "lr": 0.01, "momentum": 0.9, "nesterov": True, "weight_decay": 5e-4,
                            "use_muon": True},
                           {"params": rest, "lr": 0.01, "momentum": 0.9, "nesterov": True, "weight_decay": 0.0,
                            "use_muon": False}], muon=0.2, sgd=1.0)
    else:
        optimizer = torch.optim.SGD(parameter_groups(m, 5e-4), lr=0.01, momentum=0.937, nesterov=True)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss, _ = m.loss(batch)
        scaler.scale(loss.sum()).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(m.parameters(), max_norm=10.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()

    return step


def parameters(name: str) -> int:
    return sum(p.numel() for p in model(name).parameters())


def inference(name: str, *, fuse: bool) -> Callable[[Tensor], Any]:
    """Their eval-mode forward (which decodes boxes in the head)."""
    m = model(name).eval()
    if fuse:
        m = m.fuse(verbose=False)

    def forward(x: Tensor) -> Any:
        with torch.inference_mode():
            return m(x)

    return forward


def _head_inputs(maps: list[Tensor], reg_max: int) -> dict[str, Any]:
    """What their head passes on: boxes [B, 4R, P] and scores [B, C, P] concatenated over levels."""
    b = maps[0].shape[0]
    boxes = torch.cat([m[:, : 4 * reg_max].reshape(b, 4 * reg_max, -1) for m in maps], -1)
    scores = torch.cat([m[:, 4 * reg_max :].reshape(b, m.shape[1] - 4 * reg_max, -1) for m in maps], -1)
    return {"boxes": boxes, "scores": scores, "feats": maps}


def _nms_function() -> Callable[..., Any]:
    try:
        from ultralytics.utils.nms import non_max_suppression
    except ImportError:  # older releases keep it in ops
        from ultralytics.utils.ops import non_max_suppression
    return non_max_suppression


def decode_nms(maps: list[Tensor], *, conf: float, iou: float, multi_label: bool = False,
               max_det: int = 300) -> Callable[[], Any]:
    """Their head's decode (``Detect._inference``) on the same raw maps, then their NMS."""
    head = model("yolov8n").model[-1].eval()
    nms = _nms_function()

    def run() -> Any:
        with torch.inference_mode():
            y = head._inference(_head_inputs(maps, head.reg_max))
            return nms(y, conf, iou, multi_label=multi_label, max_det=max_det)

    return run


def loss(maps: list[Tensor], targets: Tensor, size: int) -> Callable[[], Any]:
    """Their ``v8DetectionLoss`` forward + backward, from the same per-level maps."""
    from ultralytics.utils.loss import v8DetectionLoss

    criterion = v8DetectionLoss(model("yolov8n"))
    images = torch.empty(maps[0].shape[0], 3, size, size)
    batch = batch_of(images, targets)
    reg_max = criterion.reg_max

    def step() -> None:
        leaves = [m.detach().requires_grad_() for m in maps]
        total, _ = criterion(_head_inputs(leaves, reg_max), batch)
        total.sum().backward()

    return step


def seg_loss(maps: list[Tensor], coefficients: list[Tensor], protos: Tensor, targets: Tensor, masks: Tensor,
             size: int) -> Callable[[], Any]:
    """Their ``v8SegmentationLoss`` forward + backward from the same per-level maps, coefficients and
    prototypes (their head's concatenations included)."""
    from ultralytics.utils.loss import v8SegmentationLoss

    criterion = v8SegmentationLoss(model("yolov8n-seg"))
    batch = batch_of(torch.empty(maps[0].shape[0], 3, size, size), targets)
    batch["masks"] = masks
    reg_max = criterion.reg_max

    def step() -> None:
        leaves = [m.detach().requires_grad_() for m in maps]
        coef = [c.detach().requires_grad_() for c in coefficients]
        proto = protos.detach().requires_grad_()
        preds = {**_head_inputs(leaves, reg_max), "proto": proto,
                 "mask_coefficient": torch.cat([c.flatten(2) for c in coef], 2)}
        total, _ = criterion(preds, batch)
        total.sum().backward()

    return step


def assigner(pred_scores: Tensor, pred_boxes: Tensor, points: Tensor, labels: Tensor, boxes: Tensor,
             mask: Tensor) -> Callable[[], Any]:
    """Their ``TaskAlignedAssigner`` forward on the same decoded predictions and padded GT."""
    from ultralytics.utils.tal import TaskAlignedAssigner

    tal = TaskAlignedAssigner(topk=10, num_classes=pred_scores.shape[-1], alpha=0.5, beta=6.0, stride=[8, 16, 32])
    args = (pred_scores, pred_boxes, points, labels[..., None].float(), boxes, mask[..., None].float())
    return lambda: tal(*args)


def evaluate(images: list[dict[str, np.ndarray]], num_classes: int) -> Callable[[], float]:
    """Their validator's metric path on ready predictions: per image box IoU and
    ``match_predictions``, ``DetMetrics.update_stats``, then ``DetMetrics.process``
    (``ap_per_class``). Returns their mAP50-95."""
    from ultralytics.engine.validator import BaseValidator
    from ultralytics.utils.metrics import DetMetrics, box_iou

    matcher = types.SimpleNamespace(iouv=torch.linspace(0.5, 0.95, 10))
    data = [{k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in im.items()} for im in images]
    names = {i: str(i) for i in range(num_classes)}

    def run() -> float:
        metrics = DetMetrics(names=names)
        for i, im in enumerate(data):
            cls, pred_cls = im["gt_labels"], im["labels"]
            if len(cls) and len(pred_cls):
                iou = box_iou(im["gt_boxes"], im["boxes"])
                tp = BaseValidator.match_predictions(matcher, pred_cls, cls, iou).numpy()
            else:
                tp = np.zeros((len(pred_cls), 10), dtype=bool)
            cls_np = cls.numpy()
            metrics.update_stats({"tp": tp, "conf": im["scores"].numpy(), "pred_cls": pred_cls.numpy(),
                                  "target_cls": cls_np, "target_img": np.unique(cls_np), "im_name": f"{i}.jpg"})
        metrics.process()
        return float(metrics.box.map)

    return run


def training_loader(yaml: Path, *, imgsz: int, batch: int, workers: int, cache: str | bool = False,
                    task: str = "detect", **options: Any) -> Any:
    """Their training loader: ``build_yolo_dataset`` + ``build_dataloader`` (given ``options``),
    default augmentation; ``cache`` their image cache ("ram", "disk" or False); ``task`` "segment"
    loads the polygons and draws masks."""
    from ultralytics.cfg import get_cfg
    from ultralytics.data.build import build_dataloader, build_yolo_dataset
    from ultralytics.data.utils import check_det_dataset

    cfg = get_cfg(overrides={"imgsz": imgsz, "batch": batch, "workers": workers, "data": str(yaml), "cache": cache,
                             "task": task})
    data = check_det_dataset(str(yaml))
    dataset = build_yolo_dataset(cfg, data["train"], batch, data, mode="train")
    return build_dataloader(dataset, batch, workers, shuffle=True, rank=-1, **options)


def data_loader(yaml: Path, *, imgsz: int, batch: int, workers: int, task: str = "detect"
                ) -> tuple[Callable[[int, int], Timed], Any]:
    """Their training loader (``training_loader``, ``task`` as there) and a function timing ``count`` batches
    after ``warmup``, on fresh workers each time."""
    from harness.pipeline import time_batches

    loader = training_loader(yaml, imgsz=imgsz, batch=batch, workers=workers, pin_memory=False, device="cpu",
                             task=task)

    def run(count: int, warmup: int) -> Timed:
        try:
            return time_batches(iter(loader), count, warmup, key="img")
        finally:
            loader.reset()  # shut the workers down: nothing runs between two timed runs

    return run, loader
