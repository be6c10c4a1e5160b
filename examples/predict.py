"""Detect objects with a trained (or loaded) model and save drawn images.

    python examples/predict.py runs/train/weights/model.pt path/to/images --out runs/predict_example

Weights can be any file ``yolokit.load`` reads: a yolokit run's model.pt, a .safetensors
file, an Ultralytics YOLOv8 .pt checkpoint (read safely, without ultralytics installed).
The source is anything ``yolokit.predict`` reads: an image, a folder, a glob, a video.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import cv2

import yolokit
from yolokit.predict import predict_iter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("weights")
    parser.add_argument("source", help="an image, a folder of images, a glob or a video")
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--conf", type=float, default=0.25)
    parser.add_argument("--out", default="runs/predict_example")
    args = parser.parse_args()

    model = yolokit.load(args.weights)                    # eval mode, ready to predict
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for i, result in enumerate(predict_iter(model, args.source, imgsz=args.imgsz, conf=args.conf)):
        print(f"{result.name}: {result.summary() or 'nothing'}")
        drawn = result.plot()                             # HxWx3 uint8 RGB with boxes and names
        cv2.imwrite(str(out / f"{i:05d}_{Path(result.name).stem}.jpg"), drawn[..., ::-1])


if __name__ == "__main__":
    main()
