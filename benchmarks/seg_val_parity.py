"""The same segmentation weights scored by yolokit's validation and by the reference validator (Ultralytics):
box and mask mAP50 / mAP50-95.

    /tmp/benchenv/bin/python benchmarks/seg_val_parity.py --weights runs/seg/weights/best.pt \
        --data path/to/shapes-seg/data.yaml --imgsz 256 [--json out.json]

Run where both yolokit and ultralytics import (see val_parity.py). The yolokit weights (a yolov8-seg
variant) are copied into an Ultralytics ``SegmentationModel`` by tensor name (``val_parity.ultralytics_checkpoint``
checks that both compute the same maps, coefficients and prototypes), then:

- yolokit's validation: rect batches without padding, each detection's mask sampled into its original image,
  scored with COCO's ``segm`` protocol against the split's polygons rasterized as pycocotools does
  (``yolokit.val.masks``);
- the reference validator at its default rect padding (0.5 stride) and at 0: its masks at the letterboxed
  input's resolution against its own rasterized targets (``overlap_mask`` off for validation), its 101-point
  interpolated AP; its box numbers beside.

The two protocols differ (original pixels and pycocotools' polygon rasterization against the letterboxed frame
and a bilinear 1/4 mask upsampled): the table shows by how much on a given model and set.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from ultralytics import YOLO
from val_parity import arguments, reference_padding, ultralytics_checkpoint

import yolokit
from yolokit.data import DetectionDataset, build_dataloader
from yolokit.val import validate


def yolokit_scores(weights: str, data: str, imgsz: int, num_classes: int) -> dict:
    model = yolokit.load(weights).eval()
    loader = build_dataloader(DetectionDataset(data, "val", imgsz=imgsz, rect=True, stride=max(model.strides)),
                              16, workers=0, shuffle=False)
    result, _ = validate(model, loader, num_classes=num_classes)
    return {"box_map50": result.map50, "box_map50_95": result.map50_95, "mask_map50": result.mask_map50,
            "mask_map50_95": result.mask_map50_95}


def reference_scores(checkpoint: Path, data: str, imgsz: int, pad: float, project: str) -> dict:
    with reference_padding(pad):
        out = YOLO(str(checkpoint), task="segment").val(data=data, imgsz=imgsz, batch=16, device="cpu", plots=False,
                                                        workers=0, conf=0.001, iou=0.7, max_det=300, verbose=False,
                                                        project=project, name="val", exist_ok=True)
    return {"box_map50": float(out.box.map50), "box_map50_95": float(out.box.map),
            "mask_map50": float(out.seg.map50), "mask_map50_95": float(out.seg.map)}


def main() -> None:
    args = arguments("yolov8-seg")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "reference.pt"
        nc = ultralytics_checkpoint(args.weights, checkpoint, args.imgsz)
        rows.append(("yolokit val (pad 0, original pixels, COCO segm)", yolokit_scores(args.weights, args.data,
                                                                                      args.imgsz, nc)))
        for pad in (0.5, 0.0):
            rows.append((f"reference validator (pad {pad:g})",
                         reference_scores(checkpoint, args.data, args.imgsz, pad, str(Path(tmp) / "u"))))
    keys = ("box_map50", "box_map50_95", "mask_map50", "mask_map50_95")
    print(f"{'validator':50s} " + " ".join(f"{k:>14s}" for k in keys))
    for who, m in rows:
        print(f"{who:50s} " + " ".join(f"{m[k]:14.4f}" for k in keys))
    if args.json:
        Path(args.json).write_text(json.dumps([{"validator": w, **m} for w, m in rows], indent=1))


if __name__ == "__main__":
    main()
