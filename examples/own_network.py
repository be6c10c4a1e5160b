"""Your own network, trained like ours, compared with the baseline.

Four detectors train on the generated "shapes" set (nothing is downloaded) with the same
trainer and settings, then ``compare_runs`` puts them side by side:

- ``yolov8n``: the built-in baseline;
- ``yolov8n-p2.yaml``: a packaged model YAML with a stride-4 level for small objects;
- ``v8-se.yaml``: your own file, a YOLOv8n-like network with your block (a squeeze-excite
  gate, registered with ``register_module``) after SPPF;
- ``timm``: a timm backbone (mobilenetv3_small_050, random weights; ``weights=`` takes a local
  file) under a YOLOv8 PAN neck and DFL head, composed by hand (needs ``pip install 'yolokit[timm]'``;
  left out without it).

    python examples/own_network.py                       # about 5 minutes on a 2-core CPU
    python examples/own_network.py --epochs 1 --imgsz 64 # a quick look

The YAML models' checkpoints hold their architecture (``yolokit.load`` rebuilds them; a file
naming your block needs it registered again); the hand-composed one trains and resumes when
given again, its weights in ``weights/last.pt``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

import yolokit
from yolokit.data import make_shapes
from yolokit.models import Detector, register_module
from yolokit.models.heads import DFLHead
from yolokit.models.layers import Conv
from yolokit.models.necks import YOLOv8PAN
from yolokit.train import TrainConfig, compare_runs, train

V8_SE = """
nc: 4
scales: {n: [0.33, 0.25, 1024]}
backbone:
  - [-1, 1, Conv, [64, 3, 2]]
  - [-1, 1, Conv, [128, 3, 2]]
  - [-1, 3, C2f, [128, True]]
  - [-1, 1, Conv, [256, 3, 2]]
  - [-1, 6, C2f, [256, True]]      # 4: stride 8
  - [-1, 1, Conv, [512, 3, 2]]
  - [-1, 6, C2f, [512, True]]      # 6: stride 16
  - [-1, 1, Conv, [1024, 3, 2]]
  - [-1, 3, C2f, [1024, True]]
  - [-1, 1, SPPF, [1024, 5]]
  - [-1, 1, SE, [1024, 4]]         # 10: your block, stride 32
head:
  - [-1, 1, nn.Upsample, [None, 2, nearest]]
  - [[-1, 6], 1, Concat, [1]]
  - [-1, 3, C2f, [512]]            # 13
  - [-1, 1, nn.Upsample, [None, 2, nearest]]
  - [[-1, 4], 1, Concat, [1]]
  - [-1, 3, C2f, [256]]            # 16
  - [-1, 1, Conv, [256, 3, 2]]
  - [[-1, 13], 1, Concat, [1]]
  - [-1, 3, C2f, [512]]            # 19
  - [-1, 1, Conv, [512, 3, 2]]
  - [[-1, 10], 1, Concat, [1]]
  - [-1, 3, C2f, [1024]]           # 22
  - [[16, 19, 22], 1, Detect, [nc]]
"""


class SqueezeExcite(nn.Module):
    """Channel attention, then a 1x1 convolution to ``c2`` channels (a YAML row: ``[c2, reduction]``)."""

    def __init__(self, c1: int, c2: int, reduction: int = 4):
        super().__init__()
        self.gate = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(c1, c1 // reduction, 1), nn.SiLU(),
                                  nn.Conv2d(c1 // reduction, c1, 1), nn.Sigmoid())
        self.out = Conv(c1, c2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x * self.gate(x))


def timm_detector(num_classes: int) -> Detector | None:
    """mobilenetv3_small_050's stride-8/16/32 maps under a YOLOv8 PAN neck and DFL head; None without timm."""
    try:
        from yolokit.models import TimmBackbone
        backbone = TimmBackbone("mobilenetv3_small_050", out_indices=(2, 3, 4))
    except ImportError:
        return None
    neck = YOLOv8PAN(backbone.out_channels, depth=1)
    head = DFLHead(neck.out_channels, backbone.strides, num_classes=num_classes)
    return Detector(backbone, neck, head, name="mnv3-small-pan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--imgsz", type=int, default=128)
    parser.add_argument("--images", type=int, default=64, help="training images of the shapes set")
    parser.add_argument("--out", default="runs/own_network")
    args = parser.parse_args()

    data = make_shapes(n_train=args.images, n_val=16, imgsz=args.imgsz)   # 4 classes, generated once
    register_module("SE", SqueezeExcite)                              # before any file names it
    yaml_path = Path(args.out) / "v8-se.yaml"
    yaml_path.parent.mkdir(parents=True, exist_ok=True)
    yaml_path.write_text(V8_SE)
    common = dict(data=str(data), epochs=args.epochs, imgsz=args.imgsz, batch=8, nbs=16, workers=0, plots=False,
                  warmup_epochs=1.0, close_mosaic=1)
    runs = []
    for name, model_name in (("baseline", "yolov8n"), ("p2", "yolov8n-p2.yaml"), ("se", str(yaml_path))):
        result = train(TrainConfig(model=model_name, out=f"{args.out}/{name}", **common))
        runs.append(result["run_dir"])
        print(f"{name}: {yolokit.load(Path(result['run_dir']) / 'weights' / 'model.pt').name} trained, "
              f"mAP50-95 {result['mAP50-95']:.3f}")
    mine = timm_detector(num_classes=4)
    if mine is not None:
        result = train(TrainConfig(out=f"{args.out}/timm", **common), model=mine)
        runs.append(result["run_dir"])
        print(f"timm: {mine.name} trained, mAP50-95 {result['mAP50-95']:.3f}")
    print(compare_runs(runs))


if __name__ == "__main__":
    main()
