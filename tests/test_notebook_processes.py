"""Processes started from a real Jupyter kernel, with a dataset, a transform and functions defined in its cells.

Loader workers under each default start method (spawn, forkserver: Python 3.14's on Linux; fork), and
``launch`` of a cell's function on CPU (gloo), its failure reported in the LaunchError's text. One kernel
for the default run (its start is a few seconds); the by-value starts (cloudpickle) in a second, extended.
"""

from __future__ import annotations

import pytest
from _kernel import run_cells

from yolokit.data import make_shapes

pytestmark = pytest.mark.slow

DEFINED_IN_CELLS = '''
import multiprocessing, sys, torch
from yolokit.data import DetectionDataset, build_dataloader
from yolokit.accel import distributed
from yolokit.accel.launcher import LaunchError, launch

def mirrored(image):                          # a transform of this notebook
    return image.flip(-1)

class Mirrored(DetectionDataset):             # a dataset of this notebook
    def __getitem__(self, index):
        item = super().__getitem__(index)
        item["image"] = mirrored(item["image"])
        return item

data = Mirrored(DATA, "train", imgsz=64)
reference = torch.cat([b["images"] for b in build_dataloader(data, 4, workers=0)])

def load(**kwargs):
    """The start method the workers got, and whether their batches are the notebook's."""
    loader = build_dataloader(data, 4, workers=2, **kwargs)
    images = torch.cat([b["images"] for b in loader])
    context = loader.multiprocessing_context
    loader.close()
    return (context or multiprocessing).get_start_method(), torch.equal(images, reference)
'''

LOADERS = '''
for method in ("spawn", "forkserver", "fork"):
    multiprocessing.set_start_method(method, force=True)
    print("default", method, "->", *load())
'''

LAUNCHES = '''
import atexit, os
def total(offset):                            # a function of this notebook
    distributed.setup(backend="gloo", device="cpu", timeout=60)
    value = torch.tensor([distributed.rank() + offset])
    torch.distributed.all_reduce(value)
    print(f"rank {distributed.rank()} printed", flush=True)
    return int(value), os.getpid()

atexit.register(lambda: open("exited", "a").write(f"{os.getpid()}\\n"))   # the kernel's, not its ranks'
print("written once", end="")                 # not flushed yet when the ranks are forked
results = launch(total, 2, 10, timeout=120)
print("\\nlaunched", [value for value, _ in results], "pids", *[pid for _, pid in results])
'''

FAILS = '''
def fails(n):
    raise ValueError(f"no luck with {n}")

try:
    launch(fails, 2, 3, timeout=120)
except LaunchError as exc:
    print(exc)
'''

REFUSALS = '''
sys.modules["cloudpickle"] = None             # as where it is not installed
try:
    load(multiprocessing_context="spawn")
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}")
del sys.modules["cloudpickle"]
try:
    launch(total, 2, 10, start_method="spawn")
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}")
'''


@pytest.fixture(scope="module")
def data_yaml(tmp_path_factory):
    return make_shapes(tmp_path_factory.mktemp("notebook") / "shapes", n_train=8, n_val=1, imgsz=64)


def test_a_notebooks_objects_reach_workers_and_launched_processes(data_yaml, tmp_path):
    setup, loaders, launched, failed, refused = run_cells(
        [f"DATA = {str(data_yaml)!r}\n" + DEFINED_IN_CELLS, LOADERS, LAUNCHES, FAILS, REFUSALS], tmp_path)
    assert "Error" not in setup, setup
    # whatever the default, the notebook's dataset reaches its workers by fork here (Linux, no CUDA)
    assert loaders.splitlines() == [f"default {m} -> fork True" for m in ("spawn", "forkserver", "fork")], loaders
    assert "launched [21, 21]" in launched and "rank 0 printed" in launched and "rank 1 printed" in launched
    exited = (tmp_path / "exited").read_text().split() if (tmp_path / "exited").exists() else []
    assert launched.count("written once") == 1 and not set(launched.split(" pids ")[1].split()) & set(exited)
    # the rank's exception, its message and the line of the cell that raised it
    assert "ValueError: no luck with 3" in failed and 'raise ValueError(f"no luck with {n}")' in failed, failed
    spawn_refusal, launch_refusal = refused.splitlines()
    assert spawn_refusal.startswith("PicklingError: Mirrored cannot be sent to the loader's spawn workers: ")
    assert "mirrored" in spawn_refusal or "Mirrored" in spawn_refusal.split(":", 2)[2]
    assert spawn_refusal.endswith('define it in a .py file and import it, use fork '
                                  '(multiprocessing_context="fork"), or workers=0'), spawn_refusal
    assert launch_refusal.startswith("PicklingError: launch cannot send total") and 'start_method="fork"' in \
        launch_refusal, launch_refusal


BY_VALUE = '''
for method in ("spawn", "forkserver"):
    print("asked", method, "->", *load(multiprocessing_context=method, persistent_workers=False))
'''


@pytest.mark.extended
def test_a_notebooks_dataset_goes_by_value_to_the_start_method_asked_for(data_yaml, tmp_path):
    pytest.importorskip("cloudpickle")
    setup, by_value = run_cells([f"DATA = {str(data_yaml)!r}\n" + DEFINED_IN_CELLS, BY_VALUE], tmp_path, timeout=300)
    assert "Error" not in setup, setup
    assert by_value.splitlines() == ["asked spawn -> spawn True", "asked forkserver -> forkserver True"], by_value
