"""Peak memory of predicting a folder: streamed in batches (yolokit.predict) vs every image stacked at once.

    python benchmarks/predict_memory.py --counts 60 300 --size 640 --imgsz 640 --batch 16

Writes N random JPEGs of size x size into a temporary folder, then measures each case in a
fresh subprocess (this script again, with --child): the process's peak resident memory
(``harness.timing.resident_bytes(peak=True)``, VmHWM) and wall time.
"stacked" is what ``yolokit predict`` did before it streamed: decode every image, letterbox
them all into one float batch, then run the model on that batch in chunks of ``--batch``
(only the input side is measured; one forward of 300 images at once would add far more).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np
import torch
from harness.timing import header, resident_bytes


def _child(folder: str, mode: str, imgsz: int, batch: int) -> dict:
    """One case in this (fresh) process: images predicted, peak resident MiB, seconds."""
    import yolokit
    from yolokit.predict import frames, predict_iter
    from yolokit.predict.predictor import letterbox_batch

    torch.manual_seed(0)
    model = yolokit.create_model("yolov8n", num_classes=80).eval().fuse()
    start = time.perf_counter()
    if mode == "streamed":
        count = sum(1 for _ in predict_iter(model, folder, imgsz=imgsz, batch=batch))
    else:
        images = [f.image for f in frames(folder)]
        stacked = letterbox_batch(images, imgsz, 32)[0].float() / 255  # as it was: one float batch
        with torch.inference_mode():
            for i in range(0, len(stacked), batch):
                model(stacked[i:i + batch])
        count = len(images)
    seconds = time.perf_counter() - start
    return {"images": count, "peak_mib": resident_bytes(peak=True) / 2**20, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", type=int, nargs="+", default=[60, 300])
    parser.add_argument("--size", type=int, default=640, help="side of the square test images")
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--modes", nargs="+", default=["streamed", "stacked"])
    parser.add_argument("--child", nargs=2, metavar=("FOLDER", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(*args.child, args.imgsz, args.batch)))
        return
    print(header())
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        print("| images | mode | peak RSS MB | seconds |\n|---:|---|---:|---:|")
        for count in args.counts:
            folder = Path(tmp) / str(count)
            folder.mkdir()
            for i in range(count):
                cv2.imwrite(str(folder / f"{i:05d}.jpg"), rng.integers(0, 255, (args.size, args.size, 3), np.uint8))
            for mode in args.modes:
                out = subprocess.run([sys.executable, __file__, "--imgsz", str(args.imgsz), "--batch", str(args.batch),
                                      "--child", str(folder), mode], capture_output=True, text=True, check=True)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"| {r['images']} | {mode} | {r['peak_mib']:.0f} | {r['seconds']:.1f} |", flush=True)

if __name__ == "__main__":
    main()
