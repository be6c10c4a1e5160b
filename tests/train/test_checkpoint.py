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
