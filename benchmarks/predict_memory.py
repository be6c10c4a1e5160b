"""Peak memory of predicting a folder: streamed in batches (yolokit.predict) vs every image stacked at once.

    python benchmarks/predict_memory.py --counts 60 300 --size 640 --imgsz 640 --batch 16

Writes N random JPEGs of size x size into a temporary folder, then measures each case in a
fresh subprocess: peak resident memory (VmHWM from /proc/self/status) and wall time.
"stacked" is what ``yolokit predict`` did before it streamed: decode every image, letterbox
them all into one float batch, then run the model on that batch in chunks of ``--batch``
(only the input side is measured; one forward of 300 images at once would add far more).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import cv2
import numpy as np

CASE = textwrap.dedent("""
    import sys, time, torch, yolokit
    from yolokit.predict import frames, predict_iter
    from yolokit.ops.images import letterbox_batch
    folder, mode, imgsz, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    torch.manual_seed(0)
    model = yolokit.create_model("yolov8n", num_classes=80).eval().fuse()
    start = time.perf_counter()
    if mode == "streamed":
        count = sum(1 for _ in predict_iter(model, folder, imgsz=imgsz, batch=batch))
    else:
        images = [f.image for f in frames(folder)]
        stacked, _ = letterbox_batch(images, imgsz, 32)
        with torch.inference_mode():
            for i in range(0, len(stacked), batch):
                model(stacked[i:i + batch])
        count = len(images)
    seconds = time.perf_counter() - start
    peak = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
    print(count, int(peak) / 1024, seconds)
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", type=int, nargs="+", default=[60, 300])
    parser.add_argument("--size", type=int, default=640, help="side of the square test images")
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--modes", nargs="+", default=["streamed", "stacked"])
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"| images | mode | peak RSS MB | seconds |\n|---:|---|---:|---:|")
        for count in args.counts:
            folder = Path(tmp) / str(count)
            folder.mkdir()
            for i in range(count):
                cv2.imwrite(str(folder / f"{i:05d}.jpg"), rng.integers(0, 255, (args.size, args.size, 3), np.uint8))
            for mode in args.modes:
                out = subprocess.run([sys.executable, "-c", CASE, str(folder), mode, str(args.imgsz), str(args.batch)],
                                     capture_output=True, text=True, check=True).stdout.split()
                print(f"| {out[0]} | {mode} | {float(out[1]):.0f} | {float(out[2]):.1f} |", flush=True)


if __name__ == "__main__":
    main()
