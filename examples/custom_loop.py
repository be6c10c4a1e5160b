"""A plain PyTorch training loop built from yolokit pieces and the accel toolbox.

Every accel piece is visible at the line where it acts: process setup, activation
checkpointing, mixed precision, the Accumulator (accumulation, the explicit gradient sync
over processes), out of memory survived (``run_batch``, ``retry_step``), unscale / clip /
step. ``step()`` below is, line for line, the update of ``yolokit.train.step.train_step``,
which the Trainer runs (it adds the learning-rate schedule, the EMA and its bookkeeping).
Trains YOLOv8n on the generated "shapes" dataset (nothing is downloaded); about a minute
on a 2-core CPU.

    python examples/custom_loop.py                      # one process (CPU, or one GPU)
    python examples/custom_loop.py --nprocs 2           # DDP over 2 local processes
    torchrun --nproc-per-node 2 examples/custom_loop.py # the same under torchrun
    python examples/custom_loop.py --precision bf16 --checkpointing --epochs 5

On a CPU shared with other work, OMP_NUM_THREADS=1 is often several times faster.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import yolokit
from yolokit.accel import (
    Accumulator,
    Precision,
    accumulation_steps,
    distributed,
    enable_activation_checkpointing,
    launch,
    perf,
    retry_step,
    run_batch,
)
from yolokit.data import DetectionDataset, build_dataloader, make_shapes
from yolokit.losses import YOLOv8Loss


def train(args: argparse.Namespace, data_yaml: Path) -> float:
    """One process of the run; returns the last epoch's mean loss over all processes."""
    device = distributed.setup()  # torchrun / launch environment, or a single process
    world = distributed.world_size()
    if args.batch % world:
        raise ValueError(f"--batch {args.batch} is the total over {world} processes: make it divisible")

    model = yolokit.create_model(args.model, num_classes=4).to(device)
    distributed.broadcast_module(model)  # every process starts from rank 0's weights
    if args.checkpointing:
        enable_activation_checkpointing(model.checkpoint_units("all"))
    criterion = YOLOv8Loss(model.num_classes, model.strides, reg_max=model.head.reg_max)
    precision = Precision(args.precision, device)
    print(f"rank {distributed.rank()}: {device}, {precision}, {perf.configure(cudnn_benchmark=True)}")

    # accumulation: loader batches per process per step, towards nominal_batch images over all processes
    accumulate = accumulation_steps(args.nominal_batch, args.batch // world, world)
    acc = Accumulator(model, accumulate=accumulate)
    dataset = DetectionDataset(data_yaml, "train", imgsz=args.imgsz, augment=True)
    loader = build_dataloader(dataset, args.batch // world, workers=args.workers, seed=args.seed,
                              accumulate=accumulate)  # any number of processes sees the same steps
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=5e-4)

    def forward_backward(micro: dict) -> torch.Tensor:
        images, targets = micro["images"].to(device), micro["targets"].to(device)
        with precision.autocast():
            loss, parts = criterion(model(images), targets)
        precision.backward(loss * len(images) / args.nominal_batch)  # this micro-batch's share of the step
        return loss.detach()

    def step() -> None:
        acc.sync()                                        # gradients summed over the processes
        precision.unscale_(optimizer)                     # fp16: gradients in true units
        norm = precision.clip_grad_norm_(optimizer, 10.0)
        retry_step(acc, precision.step, optimizer, norm)  # inf/NaN: skipped; out of memory: once more
        optimizer.zero_grad(set_to_none=True)

    epoch_loss = float("nan")
    for epoch in range(args.epochs):
        model.train()
        loader.set_epoch(epoch)
        acc.start_epoch(len(loader))
        start, total, batches = time.perf_counter(), torch.zeros((), device=device), 0
        for batch in loader:
            total += sum(run_batch(acc, batch, forward_backward))  # micro-batches; OOM: split, step replayed
            batches += 1
            if acc.step_due():  # this process's batches of the step have run
                step()
        while acc.step_due():  # uneven shards: the other processes' last steps
            step()
        epoch_loss = float(distributed.all_reduce_mean(total / max(batches, 1)))
        if distributed.is_main():
            print(
                f"epoch {epoch + 1}/{args.epochs}  loss {epoch_loss:.3f}  "
                f"({batches} batches of {args.batch // world} per process, {time.perf_counter() - start:.1f} s)"
            )

    if distributed.is_main() and args.save:
        torch.save(model.state_dict(), args.save)
    distributed.teardown()
    return epoch_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="yolov8n")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--imgsz", type=int, default=160)
    parser.add_argument("--batch", type=int, default=8, help="images per loader batch, all processes together")
    parser.add_argument("--nominal-batch", type=int, default=16, help="images per optimizer step, all processes")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "fp16", "bf16"])
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing (less memory)")
    parser.add_argument("--nprocs", type=int, default=1, help="processes on this machine (ignored under torchrun)")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", default="", help="where to save the final weights (rank 0)")
    args = parser.parse_args()

    data_yaml = make_shapes(n_train=64, n_val=16, imgsz=args.imgsz)  # generated once, before the processes start
    losses = launch(train, args.nprocs, args, data_yaml)
    print(f"final loss {losses[0]:.3f}")


if __name__ == "__main__":
    main()
