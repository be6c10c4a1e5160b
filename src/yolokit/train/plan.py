"""The run's runtime plan and what follows from its device: decided once, here.

``start_processes`` joins the process group when torchrun (or ``train(config)`` with
``devices`` > 1) started several processes and returns :class:`Processes`: this process's
device (made current), rank, local rank and the world. :func:`runtime_plan` adds the batch
arithmetic once the batch is known: per-rank batch, accumulation, images per step and
steps per epoch. The trainer hands the :class:`RuntimePlan` to the loader's sampler, the
Accumulator, the learning-rate schedule, the optimizer's choice and the checkpoint; none of
them works it out again, and nothing on the trainer's path asks the process group for a
rank or a world.

:func:`device_settings` resolves everything a config leaves unset (None) for the device,
in one place: precision, memory layout, kernels (cuDNN benchmark, TF32, determinism), the
optimizer's fused kernels, SyncBatchNorm, loader workers and pinning, and where the HSV
step runs. On CUDA the fast choices; on the CPU the exact ones (deterministic kernels, so
that resume is exact).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, fields

import torch

from yolokit.accel import distributed, perf
from yolokit.accel.accumulation import accumulation_steps
from yolokit.accel.amp import resolve_precision
from yolokit.data.samplers import epoch_steps
from yolokit.models import prefers_channels_last
from yolokit.train.config import TrainConfig


@dataclass(frozen=True)
class Processes:
    """The processes of a run and this one's place among them."""

    device: torch.device       # this process's device, already the current one
    rank: int                  # global rank
    local_rank: int            # rank on this machine
    world: int                 # processes in all
    local_world: int           # processes on this machine

    @property
    def main(self) -> bool:
        """Whether this is global rank 0, the process that logs and saves."""
        return self.rank == 0


@dataclass(frozen=True)
class RuntimePlan(Processes):
    """:class:`Processes` and the batch arithmetic of the run (see :func:`runtime_plan`)."""

    batch: int                 # images per loader batch over all processes
    per_rank: int              # images per loader batch on each process
    accumulate: int            # loader batches per process per optimizer step
    images_per_step: int       # accumulate * per_rank * world (an epoch's last step may hold fewer)
    steps_per_epoch: int       # optimizer steps of an epoch, the same on every rank

    def as_dict(self) -> dict[str, int | str]:
        """Plain values (the device as its name), for checkpoints and logs."""
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "device": str(self.device)}


def runtime_plan(procs: Processes, *, batch: int, nominal_batch: int, train_size: int,
                 whole_steps: bool = False) -> RuntimePlan:
    """The plan of a run of ``batch`` images per loader batch (the total) over ``procs``.

    Args:
        procs: From :func:`start_processes`.
        batch: Total images per loader batch; divides by ``procs.world``.
        nominal_batch: Images an optimizer step should represent (``nbs``).
        train_size: Images in the training split.
        whole_steps: Every rank runs whole steps only (SyncBatchNorm; see ``ShardedBatchSampler``).

    Examples:
        >>> p = Processes(torch.device("cpu"), rank=1, local_rank=1, world=2, local_world=2)
        >>> plan = runtime_plan(p, batch=16, nominal_batch=64, train_size=100)
        >>> plan.per_rank, plan.accumulate, plan.images_per_step, plan.steps_per_epoch
        (8, 4, 64, 2)
    """
    if batch < procs.world or batch % procs.world:
        raise ValueError(f"batch {batch} is the total over all processes and must be a multiple of their number "
                         f"({procs.world}); try batch {max(procs.world, batch // procs.world * procs.world)}")
    per_rank = batch // procs.world
    accumulate = accumulation_steps(nominal_batch, per_rank, procs.world)
    steps = epoch_steps(train_size, per_rank, world_size=procs.world, accumulate=accumulate, whole_steps=whole_steps)
    return RuntimePlan(**{f.name: getattr(procs, f.name) for f in fields(Processes)}, batch=batch,
                       per_rank=per_rank, accumulate=accumulate, images_per_step=accumulate * batch,
                       steps_per_epoch=steps)


def start_processes(cfg: TrainConfig) -> Processes:
    """This process's place in the run; joins the process group when torchrun (or ``train``) started several."""
    world = distributed.world_size()
    if world == 1 and cfg.devices > 1:
        raise ValueError(f"devices={cfg.devices}: start the processes with yolokit.train.train(config) "
                         "(or `yolokit train --devices N`), or run under torchrun")
    if cfg.devices not in (1, world):
        raise ValueError(f"devices={cfg.devices} but torchrun started {world} processes; leave devices unset "
                         "under torchrun")
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0 and cfg.resume != "auto":
        warnings.warn("torchrun --max-restarts restarts the group, which continues this run only with "
                      "resume='auto' (--resume auto); as it is, a restart starts a new run", stacklevel=2)
    device = distributed.setup(device=cfg.device, timeout=cfg.dist_timeout * 60)
    return Processes(device, rank=distributed.rank(), local_rank=distributed.local_rank() if world > 1 else 0,
                     world=world, local_world=distributed.local_world_size())


@dataclass(frozen=True)
class DeviceSettings:
    """What a run's device decides (see :func:`device_settings`): every switch resolved."""

    precision: str             # fp32, fp16 or bf16 (accel.amp.resolve_precision)
    channels_last: bool        # model and images laid out NHWC (models.prefers_channels_last)
    deterministic: bool
    cudnn_benchmark: bool
    tf32: bool
    fused_optimizer: bool      # torch's fused SGD / AdamW kernels (CPU and CUDA)
    sync_bn: bool              # BatchNorm as SyncBatchNorm (several CUDA processes, when asked for)
    workers: int
    pin_memory: bool
    hsv_on_device: bool = False
    augment_on: str = "workers"  # where the augmentation runs: "workers" or "device" (data.augment.device_augment)
    compile_augment: bool = False  # the device's augmentation through torch.compile (data.augment.fused)
    monitor: bool = False      # the device watched over each epoch (train.feeding)

    def apply(self) -> str:
        """Sets the global switches (``accel.perf.configure``); returns its one-line description."""
        return perf.configure(cudnn_benchmark=self.cudnn_benchmark, tf32=self.tf32, deterministic=self.deterministic)


def cores_per_process(world_on_this_machine: int = 1) -> int:
    """CPU cores this process may use: its affinity (a scheduler's share) split among the machine's processes."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, world_on_this_machine))


def device_settings(cfg: TrainConfig, procs: Processes) -> DeviceSettings:
    """``cfg``'s switches for ``procs.device``, its unset ones (None) resolved.

    CUDA: bf16 where supported (else fp16), non-deterministic kernels with cuDNN's benchmark
    (it picks the fastest convolution per shape), TF32 in float32 matmuls and convolutions,
    ``cores per process - 1`` loader workers (the training process keeps a core), pinned
    host memory, the HSV step on the device (the loader's workers only draw its gains).
    CPU: fp32, channels_last (oneDNN's NHWC kernels), deterministic kernels (an interrupted
    run resumes to the same bits), 2 workers, no pinning, HSV in the workers. Fused optimizer
    kernels on both. The device is watched over each epoch on CUDA (``train.feeding``).
    The augmentation stays in the workers on both unless ``augment_on="device"`` asks for the device
    (decode, Mosaic, warp, MixUp, HSV and flips in one batched pass there; the workers only draw the numbers
    and make the labels): "auto" means the workers. Measured on 2026-11-27 (BENCHMARKS.md "GPU"): the
    device pass makes 1,040 images/s at 640 on an H200 (about 1 ms of the GPU's time an image, as much as
    a yolov8s bf16 training step's 0.87 ms), where 15 workers make 3,010 images/s on the host; on 2026-12-04
    the trainer's yolov8s epoch ran at 842 images/s from the workers and 750 from the compiled device pass.
    ``deterministic=True`` on CUDA turns the benchmark off. SyncBatchNorm only when asked for
    and possible (several CUDA processes); asked for where it cannot act, a warning says why.
    """
    device = procs.device
    cuda = device.type == "cuda"
    deterministic = cfg.deterministic if cfg.deterministic is not None else not cuda
    workers = cfg.workers if cfg.workers is not None else (
        max(1, cores_per_process(procs.local_world) - 1) if cuda else 2)
    if cfg.sync_bn and not cuda:
        warnings.warn(f"sync_bn needs CUDA devices (SyncBatchNorm has no {device.type} kernels); training "
                      "with per-process BatchNorm, whose running statistics the processes combine exactly",
                      RuntimeWarning, stacklevel=2)
    elif cfg.sync_bn and procs.world == 1:
        warnings.warn("sync_bn has no effect in one process", RuntimeWarning, stacklevel=2)
    return DeviceSettings(
        precision=resolve_precision(cfg.precision, device),
        channels_last=cfg.channels_last if cfg.channels_last is not None else prefers_channels_last(device.type),
        deterministic=deterministic, cudnn_benchmark=cuda and not deterministic,
        tf32=cfg.tf32 if cfg.tf32 is not None else cuda, fused_optimizer=device.type in ("cpu", "cuda"),
        sync_bn=cfg.sync_bn and cuda and procs.world > 1, workers=workers, pin_memory=cuda,
        hsv_on_device=cfg.hsv_on_device if cfg.hsv_on_device is not None else cuda,
        augment_on="device" if cfg.augment_on == "device" else "workers", compile_augment=cfg.compile_augment,
        monitor=cfg.monitor if cfg.monitor is not None else cuda)
