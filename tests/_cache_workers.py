"""Run in processes started by ``launch``: the shared RAM image cache, measured from /proc."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from yolokit.accel import distributed
from yolokit.data import DetectionDataset


class _TouchAll(Dataset):
    """Item k < 2: the worker's pid; item k >= 2: also every cached image read once (every page of
    the cache touched)."""

    def __init__(self, dataset: DetectionDataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return 4

    def __getitem__(self, k: int) -> torch.Tensor:
        n = len(self.dataset) if k >= 2 else 0
        total = sum(int(self.dataset.load(i)[0].sum(dtype=np.int64)) for i in range(n))
        return torch.tensor([os.getpid(), total])


def mapping_memory(pid: int, name: str) -> tuple[int, int]:
    """(Pss, Rss) in bytes of the mappings of ``pid`` whose path contains ``name`` (/proc/<pid>/smaps)."""
    pss = rss = 0
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if not line[:1].isupper() or ":" not in line.split()[0]:       # a mapping's header line
            inside = name in line
        elif inside and line.startswith("Pss:"):
            pss += int(line.split()[1]) * 1024
        elif inside and line.startswith("Rss:"):
            rss += int(line.split()[1]) * 1024
    return pss, rss


def total_pss(pid: int) -> int:
    """Pss in bytes of the whole process (/proc/<pid>/smaps_rollup)."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def shared_cache(data_yaml: str, imgsz: int, context: str) -> dict:
    """Each rank builds the training split with cache="ram" and 2 loader workers that read every
    cached image; returns, per rank, the memory of the cache mapping in itself and its workers."""
    distributed.setup(timeout=120)
    try:
        peers = (distributed.local_rank(), distributed.local_world_size(), f"test|{os.environ['MASTER_PORT']}")
        dataset = DetectionDataset(data_yaml, "train", imgsz=imgsz, cache_images="ram", cache_peers=peers)
        cache = dataset._ram
        assert cache is not None
        order = [0, 1]                                   # the main process's sampler: the first pass reads nothing
        loader = DataLoader(_TouchAll(dataset), batch_size=None, num_workers=2, persistent_workers=True,
                            multiprocessing_context=context, sampler=order)
        pids = [os.getpid()] + sorted(int(item[0]) for item in loader)
        distributed.barrier()
        started = sum(total_pss(pid) for pid in pids)    # workers up, the cache filled, nobody read it all
        order[:] = [2, 3]
        touched = sorted((int(a), int(b)) for a, b in loader)   # each worker reads every image
        own = sum(int(dataset.load(i)[0].sum(dtype=np.int64)) for i in range(len(dataset)))
        distributed.barrier()                                   # every process has read it all
        assert [pid for pid, _ in touched] == pids[1:]
        memory = [mapping_memory(pid, "yolokit-cache-") for pid in pids]   # under its name or the temporary one
        grown = sum(total_pss(pid) for pid in pids) - started
        distributed.barrier()
        return {"rank": distributed.rank(), "bytes": int(cache.offsets[-1]), "pss": sum(m[0] for m in memory),
                "rss": [m[1] for m in memory], "sums": [own] + [t for _, t in touched], "grown": grown,
                "left": sorted(p.name for p in Path("/dev/shm").glob("yolokit-cache-*")), "processes": len(pids)}
    finally:
        distributed.teardown()
