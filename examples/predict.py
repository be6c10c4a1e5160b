"""Detect objects with a trained (or loaded) model and save drawn images.

    python examples/predict.py runs/train/weights/model.pt path/to/images --out runs/predict_example

Weights can be any file ``yolokit.load`` reads: a yolokit run's model.pt, a .safetensors
file, an Ultralytics YOLOv8 .pt checkpoint (read safely, without ultralytics installed).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import cv2

import yolokit
from yolokit.ops.images import load_images
from yolokit.viz import draw_detections


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("weights")
    parser.add_argument("source", help="an image or a folder of images")
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--conf", type=float, default=0.25)
    parser.add_argument("--out", default="runs/predict_example")
    args = parser.parse_args()

    model = yolokit.load(args.weights)                    # eval mode, ready to predict
    images, names = load_images(args.source)              # Tensor[3, H, W] uint8 RGB each
    detections = model.predict(images, conf=args.conf, imgsz=args.imgsz)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for image, name, det in zip(images, names, detections):
        print(f"{name}: {det}")
        drawn = draw_detections(image.permute(1, 2, 0).numpy(), det)
        cv2.imwrite(str(out / f"{Path(name).stem}.jpg"), drawn[..., ::-1])


if __name__ == "__main__":
    main()
