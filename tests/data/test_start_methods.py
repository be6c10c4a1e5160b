"""How the loader's workers start (yolokit.data.start_method): fork, the platform's default, or by value.

In this process, with a stand-in for a notebook: a ``__main__`` module that a fresh interpreter cannot
import, holding a class and a function as a notebook's cells would. The real kernel, under each default
start method, is tests/test_notebook_processes.py.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import pickle
import sys
import threading
import tracemalloc
import types

import pytest
import torch
from torch.utils.data import Dataset

from yolokit.data import DetectionDataset, build_dataloader
from yolokit.data import start_method as sm
from yolokit.data.start_method import FIXES, ByValueContext, worker_context


def _halved(image):
    return image // 2


class CellDataset(Dataset):
    """A dataset whose class and transform live in the notebook stand-in's ``__main__`` (``notebook``)."""

    def __init__(self, transform=_halved):
        self.transform = transform

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):
        return self.transform(torch.full((2,), index))


@pytest.fixture
def cloudpickle():
    return pytest.importorskip("cloudpickle")


@pytest.fixture
def notebook(monkeypatch):
    """``__main__`` as a notebook has it (no file to run again), holding CellDataset and its transform."""
    main = types.ModuleType("__main__")
    for obj in (CellDataset, _halved):
        monkeypatch.setattr(obj, "__module__", "__main__")
        setattr(main, obj.__name__, obj)
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sm, "default_start_method", lambda: "spawn")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    return main


def _cuda_initialized(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)


def test_a_notebooks_dataset_is_forked_while_cuda_is_not_initialized(notebook):
    assert worker_context(None, (CellDataset(),)) == "fork"


@pytest.mark.parametrize("default", ["spawn", "forkserver"])
def test_with_cuda_initialized_a_notebooks_dataset_goes_by_value(cloudpickle, notebook, monkeypatch, default):
    monkeypatch.setattr(sm, "default_start_method", lambda: default)
    _cuda_initialized(monkeypatch)
    context = worker_context(None, (CellDataset(),))
    assert isinstance(context, ByValueContext) and context.get_start_method() == default


def test_a_start_method_asked_for_is_kept_and_gets_a_notebooks_dataset_by_value(cloudpickle, notebook):
    context = worker_context("spawn", (CellDataset(),))
    assert isinstance(context, ByValueContext) and context.get_start_method() == "spawn"
    assert worker_context("fork", (CellDataset(),)) == "fork"


def test_what_a_fresh_interpreter_imports_keeps_the_platforms_default(notebook):
    assert worker_context(None, (torch.utils.data.TensorDataset(torch.zeros(3)),)) is None


def test_the_platforms_fork_is_kept_without_a_test_pickle(monkeypatch):
    monkeypatch.setattr(sm, "default_start_method", lambda: "fork")
    assert worker_context(None, (CellDataset(transform=lambda x: x),)) is None   # not even a lambda is looked at


def test_without_cloudpickle_a_notebooks_dataset_fails_at_once_in_one_line(notebook, monkeypatch):
    _cuda_initialized(monkeypatch)
    monkeypatch.setitem(sys.modules, "cloudpickle", None)
    with pytest.raises(pickle.PicklingError) as err:
        worker_context(None, (CellDataset(),))
    message = str(err.value)
    assert "\n" not in message and message.startswith("CellDataset cannot be sent to the loader's spawn workers: ")
    assert "CellDataset is defined in a notebook" in message and "cloudpickle" in message and message.endswith(FIXES)
    assert err.value.__context__ is None          # no chained traceback: the line is all


def test_what_cannot_be_pickled_at_all_fails_in_one_line(cloudpickle, notebook):
    with pytest.raises(pickle.PicklingError) as err:
        worker_context("forkserver", (CellDataset(transform=threading.Lock()),))
    assert str(err.value) == (f"CellDataset cannot be sent to the loader's forkserver workers: TypeError: cannot "
                              f"pickle '_thread.lock' object; {FIXES}")


def test_a_lambda_is_forked_like_a_notebooks_class(monkeypatch):
    monkeypatch.setattr(sm, "default_start_method", lambda: "forkserver")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert worker_context(None, (CellDataset(transform=lambda x: x),)) == "fork"


def test_by_value_carries_the_notebooks_code(cloudpickle, notebook):
    sent = pickle.dumps(sm._ByValue(CellDataset()))
    del notebook.CellDataset, notebook._halved        # as in a fresh interpreter
    received = pickle.loads(sent)
    assert type(received).__name__ == "CellDataset" and received[3].tolist() == [1, 1]


def test_by_value_pickles_shared_memory_as_a_start_does(cloudpickle):
    """multiprocessing's reductions are in the table: a shared array only goes to a starting process."""
    shared = multiprocessing.RawArray("q", 3)
    with pytest.raises(RuntimeError, match="through inheritance"):
        sm._by_value_pickler(io.BytesIO()).dump(shared)


def test_the_test_pickle_copies_no_image_cache_and_duplicates_no_descriptor(cloudpickle, shapes_yaml, monkeypatch):
    monkeypatch.setattr(sm, "default_start_method", lambda: "spawn")
    ds = DetectionDataset(shapes_yaml, "train", imgsz=128, augment=True, cache_images="ram")
    loader = build_dataloader(ds, 4, workers=2)
    objects = (ds, loader.collate_fn, loader.worker_init_fn)
    fds = len(os.listdir("/proc/self/fd"))
    tracemalloc.start()
    try:
        assert worker_context(None, objects) is None
        assert sm._rehearse(objects, by_value=True) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < ds._ram.data.nbytes / 10 and len(os.listdir("/proc/self/fd")) == fds
    ds.mosaic = False                                 # the shared switch is still this dataset's
    assert not ds.mosaic and ds._ram.get(0) is not None


def test_the_loader_starts_its_workers_by_the_method_chosen(notebook, monkeypatch):
    """The choice is made when the workers start, from what the loader was given."""
    chosen = []
    monkeypatch.setattr("yolokit.data.loader.worker_context", lambda asked, objects: chosen.append(asked) or "fork")
    loader = build_dataloader(CellDataset(), 2, workers=1, multiprocessing_context="spawn")
    loader._get_iterator()._shutdown_workers()
    assert loader.multiprocessing_context.get_start_method() == "fork"
    loader._get_iterator()._shutdown_workers()
    assert [c.get_start_method() for c in chosen] == ["spawn", "spawn"]
