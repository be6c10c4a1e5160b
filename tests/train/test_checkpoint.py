import random

import numpy as np
import pytest
import torch

from yolokit.train import files
from yolokit.train.checkpoint import load_checkpoint, rng_states, set_rng_states
from yolokit.train.files import atomic_save


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path):
    atomic_save({"rng": rng_states()}, tmp_path / "c.pt")
    first = (random.random(), np.random.rand(), torch.rand(2))
    set_rng_states(load_checkpoint(tmp_path / "c.pt")["rng"])
    second = (random.random(), np.random.rand(), torch.rand(2))
    assert first[0] == second[0] and first[1] == second[1] and torch.equal(first[2], second[2])


def test_a_save_killed_half_way_leaves_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    atomic_save({"epoch": 1, "w": torch.ones(3)}, path)

    def dying_save(obj, f):
        f.write(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt  # the process is stopped mid-write

    monkeypatch.setattr(files.torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        atomic_save({"epoch": 2}, path)
    monkeypatch.undo()
    assert load_checkpoint(path)["epoch"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]  # no temporary left behind


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        load_checkpoint(tmp_path / "missing.pt")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="bad.pt"):
        load_checkpoint(bad)


@pytest.mark.parametrize("resume", ["folder", "auto"])
def test_resuming_a_run_of_two_processes_starts_two_again(tmp_path, monkeypatch, resume):
    """`yolokit train --resume RUN` of a `--devices 2` run: two processes again (one process would restore no
    rank's RNG state, and the run would no longer be the one that stopped), whatever --devices says now."""
    from yolokit.accel import launcher
    from yolokit.train import TrainConfig, entry

    run = tmp_path / "run"
    (run / "weights").mkdir(parents=True)
    saved = TrainConfig(data="shapes", devices=2, out=str(run))
    torch.save({"train_config": saved.to_dict()}, run / "weights" / "last.pt")
    started = []
    monkeypatch.setattr(launcher, "launch", lambda fn, n, *args, **kw: started.append(n) or [{}])
    config = TrainConfig(resume=str(run)) if resume == "folder" else TrainConfig(resume="auto", out=str(run))
    entry.train(config)
    assert started == [2]
    started.clear()
    entry.train(TrainConfig(data="shapes", devices=3, out=str(tmp_path / "new"), resume="auto"))
    assert started == [3]                          # auto with nothing to resume: the flags' count
