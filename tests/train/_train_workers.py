"""Functions run in processes started by ``launch`` for the distributed training tests.

Kept out of the test files so spawned children import a plain module by name.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from yolokit.accel import distributed
from yolokit.data import DetectionDataset, build_dataloader
from yolokit.train import Trainer, TrainConfig, validate
from yolokit.train import autobatch
from yolokit.train.checkpoint import load_checkpoint

TIMEOUT_S = 60.0


def _digest(model: torch.nn.Module) -> str:
    """Bits of every parameter and buffer."""
    h = hashlib.sha1()
    for t in [*model.parameters(), *model.buffers()]:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def fit_recording(config: TrainConfig) -> dict:
    """``Trainer(config).fit()``, recording a digest of the weights after every optimizer step."""
    digests: list[str] = []
    original = Trainer._optimizer_step

    def recording(self, run, epoch):
        original(self, run, epoch)
        digests.append(_digest(run.model))

    Trainer._optimizer_step = recording
    try:
        result = Trainer(config).fit()
    finally:
        Trainer._optimizer_step = original
    return {"result": result, "digests": digests, "rank": distributed.rank()}


def fit_with_measured_batch(config: TrainConfig, per_rank: list[int] | None) -> dict:
    """Training with ``batch="auto"`` where rank r measures ``per_rank[r]`` (None: measuring fails)."""
    def measure(*args, **kwargs):
        if per_rank is None:
            raise AssertionError("batch auto was measured again on resume")
        return per_rank[distributed.rank()]

    autobatch.measure_batch = measure
    result = Trainer(config).fit()
    return {"result": result, "rank": distributed.rank()}


def validate_shard(data: str, weights: str, batch: int, imgsz: int) -> dict:
    """Distributed validation of the EMA weights in a run's checkpoint, each rank its shard."""
    distributed.setup(timeout=TIMEOUT_S)
    model, names = load_ema(weights)
    val = DetectionDataset(data, "val", imgsz=imgsz, rect=True)
    loader = build_dataloader(val, batch, workers=0, shuffle=False)
    result, _ = validate(model, loader, num_classes=len(names))
    out = {"stats": result.stats.tolist(), "batches": len(loader), "per_class": result.per_class_ap.tolist(),
           "images": sum(len(b["indices"]) for b in loader)}
    distributed.teardown()
    return out


def load_ema(path: str) -> tuple[torch.nn.Module, list[str]]:
    """The EMA model of a training checkpoint."""
    from yolokit.models import create_model

    state = load_checkpoint(Path(path))
    config = state["model_config"]
    model = create_model(config["name"], num_classes=config["num_classes"])
    model.load_state_dict(state["ema"]["module"])
    return model.eval(), [str(i) for i in range(config["num_classes"])]
