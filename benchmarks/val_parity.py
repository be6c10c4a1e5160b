"""The same weights scored by `yolokit val` and by the reference validator (Ultralytics).

    /tmp/benchenv/bin/python benchmarks/val_parity.py --weights runs/train/weights/last.pt \
        --data path/to/shapes/data.yaml --imgsz 256 [--json out.json]

Run with an interpreter where both yolokit and ultralytics import (the bench environment:
``pip install 'yolokit[bench]'`` plus ``pip install -e .`` of this checkout). The yolokit
weights (any file ``yolokit.load`` reads; a yolov8 variant) are copied into an Ultralytics
``DetectionModel`` by tensor name and saved as an Ultralytics checkpoint, so both sides
run the same numbers. Then, for the reference's rectangular-batch padding of 0.5 stride
(its default) and of 0:

- the reference validator's own mAP50 / mAP50-95 (it matches boxes in the letterboxed
  input frame, predictions unclipped);
- its predictions mapped to original pixels (as it maps them for COCO json), scored by
  the reference's metric code and by yolokit's (COCO's, pycocotools-exact): the metric
  difference alone;
- yolokit's validation (its loader, multi-label NMS, original-pixel scoring), scored by
  both metric codes.

Prints a table; ``--json`` writes it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from ultralytics import YOLO
from ultralytics.data import dataset as ultra_dataset
from ultralytics.models.yolo.detect import DetectionValidator
from ultralytics.nn.tasks import DetectionModel, SegmentationModel
from ultralytics.utils import ops as ultra_ops
from ultralytics.utils.metrics import ap_per_class, box_iou

import yolokit
from yolokit.data import DetectionDataset, build_dataloader
from yolokit.interop.ultralytics import to_spec_names, yolokit_name
from yolokit.ops.nms import Detections
from yolokit.val import loop as evaluate  # validate, and the coco_evaluate it calls (patched below)


def ultralytics_checkpoint(weights: str, path: Path, imgsz: int) -> int:
    """Writes yolokit ``weights`` as an Ultralytics checkpoint at ``path``; returns the class count."""
    ours = yolokit.load(weights)
    kind = SegmentationModel if ours.name.endswith("-seg") else DetectionModel   # a -seg variant: its masks too
    theirs = kind(f"{ours.name}.yaml", nc=ours.num_classes, verbose=False)
    source = ours.state_dict()
    if hasattr(ours.backbone, "rows"):     # a model built from a model YAML (the -seg variants): its rows' names
        name = lambda k: next(iter(to_spec_names({k: None}, model=ours)))  # noqa: E731
    else:
        name = yolokit_name
    theirs.load_state_dict({k: source[name(k)] for k in theirs.state_dict()}, strict=True)
    theirs.names = dict(enumerate(ours.names))
    theirs.args = {"imgsz": imgsz, "task": "segment" if kind is SegmentationModel else "detect"}
    theirs.task = theirs.args["task"]      # what their loader reads to pick the validator
    torch.save({"model": theirs.float(), "train_args": {}, "date": None, "version": "bench"}, path)
    x = torch.rand(1, 3, imgsz, imgsz)
    with torch.no_grad():
        mine, copied = _tensors(ours.eval()(x)), _tensors(yolokit.load(path).eval()(x))
        diff = max(float((a - b).abs().max()) for a, b in zip(mine, copied, strict=True))
    assert diff == 0.0, f"the Ultralytics copy computes something else (max difference {diff})"
    return ours.num_classes


def _tensors(out) -> list[torch.Tensor]:
    """A forward's output as a flat list of tensors: maps, a seg model's coefficients and prototypes, an end-to-end
    model's two branches (a dict's values by key)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for k in sorted(out) for t in _tensors(out[k])]
    return [t for v in out for t in _tensors(v)]


@contextlib.contextmanager
def reference_padding(pad: float):
    """The reference's rect validation batches padded by ``pad`` strides (its default 0.5) while inside."""
    original = ultra_dataset.YOLODataset.__init__

    def with_pad(self, *args, **kwargs):
        if "pad" in kwargs:
            kwargs["pad"] = pad
        original(self, *args, **kwargs)

    ultra_dataset.YOLODataset.__init__ = with_pad
    try:
        yield
    finally:
        ultra_dataset.YOLODataset.__init__ = original


def arguments(kind: str) -> argparse.Namespace:
    """The two parity scripts' flags: ``--weights``, ``--data``, ``--imgsz``, ``--json``."""
    parser = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__.split("\n\n")[0])
    parser.add_argument("--weights", required=True, help=f"yolokit weights of a {kind} variant")
    parser.add_argument("--data", required=True, help="data.yaml of a YOLO-format dataset")
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--json", help="write the table here")
    return parser.parse_args()


def reference_run(checkpoint: Path, data: str, imgsz: int, pad: float, project: str) -> tuple[dict, list, list, list]:
    """The reference validator at rect padding ``pad``: (its metrics, and per image sorted by file: its
    predictions and GT in original pixels, the original shapes)."""
    records: dict[str, tuple] = {}

    class Recording(DetectionValidator):
        def update_metrics(self, preds, batch):
            super().update_metrics(preds, batch)
            for si, pred in enumerate(preds):
                pb = self._prepare_batch(si, batch)
                predn = self.scale_preds(self._prepare_pred(pred), pb)
                gt = ultra_ops.scale_boxes(pb["imgsz"], pb["bboxes"].clone(), pb["ori_shape"], pb["ratio_pad"])
                records[pb["im_file"]] = (Detections(predn["bboxes"].float(), predn["conf"].float(),
                                                     predn["cls"].long()),
                                          (gt.numpy(), pb["cls"].long().numpy()), tuple(pb["ori_shape"]))

    with reference_padding(pad):
        out = YOLO(str(checkpoint)).val(data=data, imgsz=imgsz, batch=16, device="cpu", plots=False, workers=0,
                                        conf=0.001, iou=0.7, max_det=300, verbose=False, validator=Recording,
                                        project=project, name="val", exist_ok=True)
    files = sorted(records)
    metrics = {"map50": float(out.box.map50), "map50_95": float(out.box.map)}
    return metrics, *([records[f][k] for f in files] for k in range(3))


def reference_metric(preds: list[Detections], targets: list[tuple]) -> dict:
    """The reference's matching and AP code on per-image predictions in original pixels."""
    v = DetectionValidator()
    v.iouv, v.niou = torch.linspace(0.5, 0.95, 10), 10
    tps, confs, pcls, tcls = [], [], [], []
    for d, (boxes, labels) in zip(preds, targets, strict=True):
        gt, cls = torch.as_tensor(boxes, dtype=torch.float32).reshape(-1, 4), torch.as_tensor(labels)
        tp = (v.match_predictions(d.labels.float(), cls.float(), box_iou(gt, d.boxes.float())).numpy()
              if len(cls) and len(d) else np.zeros((len(d), 10), bool))
        tps.append(tp), confs.append(d.scores.numpy()), pcls.append(d.labels.numpy()), tcls.append(cls.numpy())
    ap = ap_per_class(np.concatenate(tps), np.concatenate(confs), np.concatenate(pcls), np.concatenate(tcls))[5]
    return {"map50": float(ap[:, 0].mean()), "map50_95": float(ap.mean())}


def yolokit_run(weights: str, data: str, imgsz: int, num_classes: int) -> tuple[dict, list, list, list]:
    """yolokit's validation: (metrics, predictions, GT, original shapes)."""
    model = yolokit.load(weights).eval()
    loader = build_dataloader(DetectionDataset(data, "val", imgsz=imgsz, rect=True, stride=max(model.strides)),
                              16, workers=0, shuffle=False)
    seen = []
    original = evaluate.coco_evaluate

    def recording(preds, targets, shapes, n):
        seen.append((preds, targets, shapes))
        return original(preds, targets, shapes, n)

    evaluate.coco_evaluate = recording
    try:
        result, _ = evaluate.validate(model, loader, num_classes=num_classes)
    finally:
        evaluate.coco_evaluate = original
    preds, targets, shapes = seen[0]
    return {"map50": result.map50, "map50_95": result.map50_95}, preds, targets, shapes


def main() -> None:
    args = arguments("yolov8")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "reference.pt"
        nc = ultralytics_checkpoint(args.weights, checkpoint, args.imgsz)
        ours, our_preds, our_targets, _ = yolokit_run(args.weights, args.data, args.imgsz, nc)
        rows.append(("yolokit val (pad 0, original pixels)", "yolokit (COCO 101-point)", ours))
        rows.append(("yolokit val (pad 0, original pixels)", "reference", reference_metric(our_preds, our_targets)))
        for pad in (0.5, 0.0):
            validator, preds, targets, shapes = reference_run(checkpoint, args.data, args.imgsz, pad,
                                                              str(Path(tmp) / "u"))
            name = f"reference validator (pad {pad:g})"
            rows.append((name, "reference, letterboxed frame", validator))
            rows.append((name, "reference, original pixels", reference_metric(preds, targets)))
            coco = evaluate.coco_evaluate(preds, targets, shapes, nc)
            rows.append((name, "yolokit (COCO 101-point)", {"map50": coco.map50, "map50_95": coco.map50_95}))
    print(f"{'predictions':40s} {'scored by':30s} {'mAP50':>8s} {'mAP50-95':>9s}")
    for who, metric, m in rows:
        print(f"{who:40s} {metric:30s} {m['map50']:8.4f} {m['map50_95']:9.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps([{"predictions": w, "metric": s, **m} for w, s, m in rows], indent=1))


if __name__ == "__main__":
    main()
