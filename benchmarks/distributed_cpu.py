"""One process of 2 threads vs 2 gloo processes of 1 thread: images/s and parity of a short yolov8n run.

Both runs train the same micro-batches of 4 images (one process: batch 4 accumulating 2 per step;
two processes: batch 8, 4 each, no accumulation), so they take the same optimizer steps. The parity
figure, the largest relative difference per tensor of the final weights, compares the two processes
with one process of 1 thread (the same kernels; with 2 threads the one-process run itself rounds
differently) and warmup's bias learning rate at 0, as the parity test does.

    flock /tmp/yolokit-cpu.lock python benchmarks/distributed_cpu.py
"""

from __future__ import annotations

import csv
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

from yolokit.accel.launcher import launch
from yolokit.data import make_shapes
from yolokit.train import TrainConfig, Trainer
from yolokit.train.checkpoint import load_checkpoint


def fit(config: TrainConfig) -> None:
    Trainer(config).fit()


def images_per_second(run: Path, images: int) -> float:
    """Training images over the last epoch's seconds (its validation of 4 images included)."""
    rows = list(csv.DictReader((run / "results.csv").open()))
    return images / float(rows[-1]["seconds"])


def worst_relative(a: dict, b: dict) -> float:
    worst = 0.0
    for key, x in a.items():
        if x.is_floating_point() and x.norm() > 0:
            worst = max(worst, float((b[key].double() - x.double()).norm() / x.double().norm()))
    return worst


def main() -> None:
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    root = Path(tempfile.mkdtemp(prefix="yolokit-ddp-bench-"))
    n_train, epochs = 64, 3
    data = str(make_shapes(root / "set", n_train=n_train, n_val=4, imgsz=128))
    base = dict(data=data, imgsz=128, nbs=8, epochs=epochs, workers=0, plots=False, mosaic_buffer=0,
                warmup_epochs=1.0, warmup_bias_lr=0.0, close_mosaic=1, seed=0, optimizer="SGD", lr0=0.01)
    torch.set_num_threads(2)
    fit(TrainConfig(**base, batch=4, out=str(root / "one")))
    torch.set_num_threads(1)
    fit(TrainConfig(**base, batch=4, out=str(root / "one_thread")))
    launch(fit, 2, TrainConfig(**base, batch=8, out=str(root / "two")), timeout=1200)   # 1 thread each
    one, two = root / "one", root / "two"
    a, b, c = (load_checkpoint(r / "weights" / "last.pt") for r in (root / "one_thread", two, one))
    print(f"torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"{platform.processor() or platform.machine()}")
    print(f"yolov8n, {n_train} shapes images at 128 px, micro-batches of 4, 8 images per step, {epochs} epochs")
    print(f"1 process x 2 threads:  {images_per_second(one, n_train):.1f} images/s (last epoch)")
    print(f"2 processes x 1 thread: {images_per_second(two, n_train):.1f} images/s (last epoch)")
    print(f"1 process x 1 thread:   {images_per_second(root / 'one_thread', n_train):.1f} images/s (last epoch)")
    print(f"steps {a['steps']} vs {b['steps']}; largest relative difference per tensor, 2 processes vs 1 process "
          f"of 1 thread: weights {worst_relative(a['model'], b['model']):.2e}, "
          f"EMA {worst_relative(a['ema']['module'], b['ema']['module']):.2e}; "
          f"1 process of 2 threads vs 1 thread: weights {worst_relative(a['model'], c['model']):.2e}")


if __name__ == "__main__":
    sys.exit(main())
