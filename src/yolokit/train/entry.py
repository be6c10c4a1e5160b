"""``train(config)``: one process, several on this machine, or one rank of torchrun's; and what a stop leaves.

A run that Ctrl-C (or SIGTERM) stops raises :class:`yolokit.accel.Interrupted` from here with
nothing of the run attached: no traceback through the trainer's frames (whose locals hold the
model, its EMA, the optimizer and the loaders), no chained exceptions, and the run's objects
collected before it is raised. A notebook keeps the last exception (``sys.last_value``); so kept,
this one holds one line of text, the resume in Python, and no memory of the run.
"""

from __future__ import annotations

import json
import signal
from typing import Any

import torch

from yolokit.accel import Interrupted, distributed
from yolokit.models import Detector
from yolokit.train.callbacks import Callback
from yolokit.train.checkpoint import resolve_run
from yolokit.train.config import TrainConfig
from yolokit.train.process_state import release_memory
from yolokit.train.trainer import Trainer


def _train_worker(config: TrainConfig, model: Detector | None, callbacks: list[Callback] | None) -> dict[str, Any]:
    return Trainer(config, model=model, callbacks=callbacks).fit()


def train(config: TrainConfig, *, model: Detector | None = None,
          callbacks: list[Callback] | None = None) -> dict[str, Any]:
    """Trains and returns the final metrics (of rank 0 when several processes train).

    ``model``: a Detector of yours to train instead of the one ``config.model`` names. ``callbacks``: yours,
    after the run's own (:class:`yolokit.train.Callback`; with several processes, on rank 0 unless they set
    ``all_ranks``). Under torchrun every process trains as one rank of the group (the world comes from the
    environment). Otherwise ``config.devices`` > 1 (a resumed run: its saved config's) starts that many
    local processes.

    Raises:
        yolokit.accel.Interrupted: Ctrl-C or SIGTERM stopped the run (saved at its last optimizer step):
            one line that says how to resume, and nothing of the run kept alive.
    """
    devices = resolve_run(config)[0].devices if config.resume else config.devices   # a resumed run: its own
    try:
        if devices > 1 and distributed.world_size() == 1:
            from yolokit.accel.launcher import launch
            result = launch(_train_worker, devices, config, model, callbacks)[0]
        else:
            result = Trainer(config, model=model, callbacks=callbacks).fit()
    except KeyboardInterrupt as exc:
        stop = stopped(exc)
    else:
        if _device_memory_held():                 # the run's objects are gone: their memory back now
            release_memory()
        return result
    release_memory()                              # a stopped run's, whatever the device
    raise stop


def _device_memory_held() -> bool:
    """Whether CUDA holds memory a finished run's cycles may keep (on the CPU Python's own collector comes
    soon enough; a full collection costs 0.2-0.4 s a run, which a suite of hundreds of runs feels)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def stopped(exc: KeyboardInterrupt) -> Interrupted:
    """A new :class:`Interrupted` that says what ``exc`` (and any stop it interrupted: a second Ctrl-C during
    the first one's save) says, with no traceback and no chained exception: nothing of the run held."""
    chain, link = [], exc
    while isinstance(link, BaseException) and link not in chain:
        chain.append(link)
        link = link.__context__
    first = next((e for e in reversed(chain) if isinstance(e, Interrupted)), None) or Interrupted()
    saved = next((e for e in chain if isinstance(e, Interrupted) and e.run_dir is not None), None)
    name = signal.Signals(first.signum).name
    if saved is not None:
        text = (f"stopped by {name} after {saved.steps} optimizer steps, saved in {saved.run_dir}; resume with "
                f"train(TrainConfig(resume={json.dumps(saved.run_dir)}))")
    else:
        text = f"stopped by {name}" + ("" if len(chain) == 1 else " (again during the stop: at once)")
    stop = Interrupted(first.signum, text)
    stop.reported = any(getattr(e, "reported", False) for e in chain)
    stop.run_dir, stop.steps = (saved.run_dir, saved.steps) if saved is not None else (None, None)
    return stop
