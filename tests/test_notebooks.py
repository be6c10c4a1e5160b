"""yolokit in a real Jupyter kernel (ipykernel through nbclient), as a notebook user meets it, and the notebooks of
examples/notebooks/.

The default run starts one kernel: a run stopped by interrupting the kernel (one line naming the resume in
Python, nothing of the run left: no Trainer or Detector, memory back, no process, the process's settings as
before), its resume in the same kernel (a widget bar per epoch, a few short lines), then the views of the
run, a prediction and an evaluation (HTML tables, PNG images). The notebooks of examples/notebooks/ run
whole, shortened, in ``-m extended``: their paths are this test's (train, predict, show, curves, compare)
and tests/test_notebook_processes.py's (cell-defined datasets in workers, ``launch`` of a cell's function).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from _kernel import run_notebook

from yolokit.data import make_shapes

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "examples" / "notebooks").glob("*.ipynb"))
nbformat = pytest.importorskip("nbformat")

RUN = 'TrainConfig(data=DATA, epochs=2, imgsz=64, batch=4, nbs=4, workers=1, plots=False, out="runs/stopped")'
CELLS = [
    # 0: a stop mark, defined in a cell; the state before the run
    """import gc, os, time, torch
from yolokit.train import Callback, TrainConfig, Trainer, compare_runs, read_results, train
from yolokit.models import Detector
from yolokit.train.process_state import ProcessState

class StopHere(Callback):
    '''Marks the second batch, then waits there for the kernel's interrupt.'''
    def __init__(self):
        self.batches = 0
    def on_batch_end(self, *args):
        self.batches += 1
        if self.batches == 2:
            open("interrupt-now", "w").close()
            time.sleep(60)

def resident_mb():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

torch.use_deterministic_algorithms(False)    # what torch imports on its first use, before measuring
gc.collect(); before, memory = ProcessState.capture(), resident_mb()""",
    # 1: the run, stopped by the kernel's interrupt
    f"train({RUN}, callbacks=[StopHere()])",
    # 2: what is left of it
    """import multiprocessing
gc.collect()
left = [type(o).__name__ for o in gc.get_objects() if type(o) in (Trainer, Detector)]
print(json.dumps({"left": left, "grown_mb": resident_mb() - memory, "moved": ProcessState.capture().differences(before),
                  "children": len(multiprocessing.active_children())}))""",
    # 3: resumed in the same kernel, to its end: what a run prints
    'resumed = train(TrainConfig(resume="runs/stopped"))',
    # 4-6: its views
    "read_results(resumed['run_dir'])",
    "read_results(resumed['run_dir']).plot()",
    "compare_runs([resumed['run_dir'], resumed['run_dir']])",
    # 7-8: a prediction and an evaluation
    """import yolokit
from yolokit.predict import predict
model = yolokit.load("runs/stopped/weights/model.pt")
(result,) = predict(model, sorted((Path(DATA).parent / "images" / "val").glob("*.jpg"))[:1], imgsz=64)
result""",
    """from yolokit.data import DetectionDataset, build_dataloader
from yolokit.val import validate
evaluation, _ = validate(model, build_dataloader(DetectionDataset(DATA, "val", imgsz=64, rect=True), 4, workers=0),
                         num_classes=model.num_classes)
evaluation""",
]


def _streams(cell) -> str:
    return "".join(o.text for o in cell.outputs if o.output_type == "stream")


def _data(cell, kind: str) -> list[str]:
    return [o.data[kind] for o in cell.outputs if o.output_type in ("execute_result", "display_data")
            and kind in o.data]


@pytest.mark.slow
def test_a_notebook_stops_with_one_line_resumes_and_shows_its_run(tmp_path):
    """That the resumed run ends with the bits of one never stopped: test_resume_iters.py's
    test_ctrl_c_between_steps_drops_the_partial_step, through the same train() in one process."""
    data = make_shapes(tmp_path / "set", n_train=8, n_val=4, imgsz=64)
    cells = [f"import json\nfrom pathlib import Path\nDATA = {str(data)!r}\n" + CELLS[0], *CELLS[1:]]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    run_notebook(notebook, tmp_path, timeout=240, interrupt=(1, tmp_path / "interrupt-now"))
    cells = notebook.cells
    errors = {i: o for i, c in enumerate(cells) for o in c.outputs if o.output_type == "error"}
    assert list(errors) == [1], {i: "\n".join(o.traceback)[-2000:] for i, o in errors.items()}

    # the stop: one line, with the resume in Python; nothing of the run kept
    error = errors[1]
    assert error.ename == "Interrupted" and len(error.traceback) <= 15, error.traceback
    assert error.evalue == ('stopped by SIGINT after 2 optimizer steps, saved in runs/stopped; resume with '
                            'train(TrainConfig(resume="runs/stopped"))'), error.evalue
    left = json.loads(_streams(cells[2]))
    assert left["left"] == [] and left["moved"] == [] and left["children"] == 0, left
    assert left["grown_mb"] < 100, left

    # what the resumed run printed: a widget bar per epoch, a few short lines (the config file, not the config)
    printed = _streams(cells[3])
    assert len(printed) < 2 * 5000 and printed.count("  val: P") == 2, printed
    assert "config: runs/stopped/config.yaml" in printed and "resuming at" in printed, printed
    assert len(_data(cells[3], "application/vnd.jupyter.widget-view+json")) == 2, cells[3].outputs
    # the views: HTML tables, the curves and the prediction as images, short text
    assert "<table>" in _data(cells[4], "text/html")[0] and _data(cells[5], "image/png")
    assert "runs/stopped" in _data(cells[6], "text/html")[0]
    assert _data(cells[7], "image/png") and _data(cells[7], "text/plain")[0].startswith("Result(path=")
    assert "<table>" in _data(cells[8], "text/html")[0]
    assert len(_data(cells[8], "text/plain")[0]) < 300


def test_the_notebooks_are_stored_without_outputs():
    """What git holds is the code: no outputs, no execution counts (they are made by running)."""
    assert [p.name for p in NOTEBOOKS] == ["fine_tuning.ipynb", "getting_started.ipynb", "own_loop.ipynb"]
    for path in NOTEBOOKS:
        notebook = nbformat.read(path, as_version=4)
        nbformat.validate(notebook)
        code = [c for c in notebook.cells if c.cell_type == "code"]
        assert code and all(not c.outputs and c.execution_count is None for c in code), path.name
        tracked = subprocess.run(["git", "ls-files", "--error-unmatch", str(path)], cwd=ROOT, capture_output=True)
        assert tracked.returncode in (0, 1)          # in a checkout (0) or before its first commit (1)


# Shorter runs, as tests/test_doc_blocks.py shortens the pages' blocks: sizes only, never what a cell does.
SHORTER = [(r"epochs=\d+", "epochs=1"), (r"imgsz=\d+", "imgsz=64"), (r"n_train=\d+", "n_train=16"),
           (r"\[:4\]", "[:2]"), (r"def fit\(epochs: int = \d+", "def fit(epochs: int = 1")]


@pytest.mark.extended
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_notebook_runs_to_its_end(path, tmp_path):
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            for pattern, replacement in SHORTER:
                cell.source = re.sub(pattern, replacement, cell.source)
            cell.source = cell.source.replace('resume=tuned["run_dir"], epochs=1', 'resume=tuned["run_dir"], epochs=2')
    run_notebook(notebook, tmp_path, timeout=600)
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]
    errors = ["\n".join(o.traceback)[-3000:] for o in outputs if o.output_type == "error"]
    assert not errors, errors[0]
    shown = [o for o in outputs if o.output_type in ("execute_result", "display_data")]
    if path.stem == "getting_started":
        assert sum("image/png" in o.data for o in shown) >= 3 and sum("text/html" in o.data for o in shown) >= 2
    if path.stem == "fine_tuning":
        assert any("runs/tuned" in o.data.get("text/html", "") for o in shown)
    if path.stem == "own_loop":
        assert re.search(r"\[\d+\.\d+, \d+\.\d+\]", shown[-1].data["text/plain"]), shown[-1].data
