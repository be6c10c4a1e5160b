"""Pieces :meth:`yolokit.train.Trainer.setup` builds: the family's loss, the seeds, the datasets."""

from __future__ import annotations

import os
import random
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

import yolokit.losses
from yolokit.accel import distributed
from yolokit.data import DetectionDataset
from yolokit.models import Detector
from yolokit.models.zoo import family_of
from yolokit.train.config import TrainConfig


def build_loss(model: Detector, config: TrainConfig) -> nn.Module:
    """The family's loss (``models.zoo.FAMILIES``), from the head's facts and the config's gains."""
    family = family_of(model.config)
    gains = {name: getattr(config, name) for name in family.loss_gains}
    return getattr(yolokit.losses, family.loss)(**family.loss_facts(model.head), **gains)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_datasets(cfg: TrainConfig, report: Callable[[str], None] = print
                   ) -> tuple[DetectionDataset, DetectionDataset]:
    """The train and val splits, built by every process itself: nobody waits in a collective.

    A rank that waited for rank 0's scan of a large dataset would wait in a collective and could
    trip its timeout (``dist_timeout``); scanning on every rank keeps them in step. The label
    cache is written atomically and the built-in ``shapes`` set is generated atomically, so
    ranks that race to write them read whole files. ``fraction`` draws the training images
    with ``seed`` (the same on every rank and after a resume); ``classes`` and ``single_cls``
    apply to both splits. ``report`` receives what they left out.
    """
    chosen = dict(classes=cfg.classes, single_cls=cfg.single_cls)
    train_set = DetectionDataset(cfg.data, "train", imgsz=cfg.imgsz, augment=True, hyp=cfg.augment,
                                 cache_images=cfg.cache, cache_peers=cache_peers("train"),
                                 buffer_size=cfg.mosaic_buffer, fraction=cfg.fraction, subset_seed=cfg.seed, **chosen)
    val_set = DetectionDataset(cfg.data, "val", imgsz=cfg.imgsz, rect=True, cache_images=cfg.cache,
                               cache_peers=cache_peers("val"), **chosen)
    for split, data in (("train", train_set), ("val", val_set)):
        for note in data.selection_notes:
            report(f"{split}: {note}")
    return train_set, val_set


def cache_peers(split: str) -> tuple[int, int, str]:
    """``(local_rank, local_world, token)``: the processes of this machine share one image cache per
    split (``cache="ram"``) and split its filling; the token names this run and this start of it
    (a torchrun restart builds a new cache)."""
    env = os.environ
    token = "|".join([split, env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", ""),
                      env.get("TORCHELASTIC_RUN_ID", ""), env.get("TORCHELASTIC_RESTART_COUNT", "")])
    return distributed.local_rank(), distributed.local_world_size(), token
