"""Every Python block of README.md and of the site's pages (docs/) runs as a user runs it: as a script, to
its end, exit code 0.

Each block runs as ``python block.py`` would, in a process of its own (with a timeout; forked
from one that imported torch and yolokit once, see ``RUNNER``), in a fresh copy of the folder
tests/_pages.py stages: it holds what the blocks' placeholder paths name, so the pages need no
edits to run.

Runs are shortened by the substitutions in ``SHORTER`` (documented in the README), which
change sizes, never what a block does: every epoch count becomes 1 (2 where a resume must
add one), ``imgsz`` 64, ``devices`` 2 (without loader workers), a batch of 64 becomes 8,
``save_period_iters`` 2, every ``trials`` count 2.

The scripts in examples/ run in tests/test_examples.py; a test here checks that each has one.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _pages import NOT_RUN, PAGES

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SHORTER = [  # (pattern, replacement), applied in order to every block
    (r"(?<![\w.])epochs=\d+", "epochs=1"),
    (r"(resume=\"[^\"]*\", epochs=)1", r"\g<1>2"),        # a resume adds an epoch
    (r"epochs, close_mosaic = \d+, \d+", "epochs, close_mosaic = 2, 1"),
    (r"for epoch in range\(\d+\)", "for epoch in range(1)"),
    (r"imgsz=\d+", "imgsz=64"),
    (r"devices=\d+", "devices=2, workers=0"),   # loader workers in each of 2 processes: only slower here
    (r"batch=64", "batch=8"),
    (r"save_period_iters=\d+", "save_period_iters=2"),
    (r"trials=\d+", "trials=2"),
]




def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, code) of every ```python block."""
    return [(line, code) for line, code, _ in marked_blocks(text)]


def marked_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(line number, code, why it is not run or None) of every ```python block; the reason is the
    ``<!-- not run: ... -->`` comment on the line before it (a page shows no HTML comment)."""
    blocks, lines = [], text.splitlines()
    start = None
    for i, line in enumerate(lines, 1):
        if start is None and line.strip() == "```python":
            start = i
        elif start is not None and line.strip() == "```":
            before = next((b.strip() for b in reversed(lines[:start - 1]) if b.strip()), "")
            why = NOT_RUN.match(before)
            blocks.append((start, "\n".join(lines[start:i - 1]) + "\n", why.group(1).strip() if why else None))
            start = None
    return blocks


MARKED = [(f"{page.relative_to(ROOT)}:{line}", code, why)
          for page in PAGES for line, code, why in marked_blocks(page.read_text())]
BLOCKS = [(where, code) for where, code, why in MARKED if why is None]
# Blocks that repeat end to end what a dedicated test runs (named beside each) run with
# `pytest -m extended`; by default they compile, every name they import exists and every
# TrainConfig field they set is one (test_an_extended_block_names_only_what_exists).
EXTENDED = {
    "yolokit.tune(": "tests/train/test_tune.py",
    "print(compare_runs(runs))": "tests/test_examples.py (examples/own_network.py), tests/train/test_own_network.py",
    'tracker="wandb"': "tests/train/test_trackers.py, tests/train/test_mlflow_stores.py",
    'export_onnx(model, "model.onnx"': "tests/interop/test_onnx.py, test_native.py, test_darknet.py",
    'yolokit.export(model, "onnx"': "tests/deploy/test_export.py, tests/deploy/test_command.py",
    "freeze=10": "tests/train/test_freeze.py, tests/train/test_compare.py",
    "save_period_iters=500": "tests/train/test_resume_iters.py",
    "devices=4": "tests/train/test_distributed_training.py",
    "rect=True, multi_scale=True": "tests/train/test_rect_multiscale.py",
    'weights="best.pt", data=': "tests/train/test_weights.py",
    "distributed.broadcast_module(model)": "tests/test_examples.py (examples/custom_loop.py, two processes)",
    'augment_on="device"))': "tests/train/test_augment_on.py, tests/data/test_device_augment.py",
    "compile_augment=True))": "tests/data/test_fused_pass.py, tests/train/test_augment_on.py",
    'optimizer="MuSGD"))': "tests/train/test_yolo26_train.py",
    'metrics = train(TrainConfig(data="shapes", epochs=3, imgsz=128))': "README.md:44 (train, load, predict)",
    'out="runs/shapes")': "README.md:44 (train, then load the weights the metrics name)",
    "print(len(dataset), dataset.names)": "README.md:44 (train on a data.yaml), tests/data/test_sources.py",
    'train(TrainConfig(weights="yolov8n.pt"': "tests/train/test_weights.py, tests/interop (their checkpoints)",
    'summary = write_shards("path/to/data.yaml", "shards"': "tests/train/test_train_shards.py, test_shards.py",
    'model="yolov8n-seg", data=str(data), epochs=10': "tests/train/test_seg_training.py (train, resume, 1 = N)",
    'print(batch["mask_rows"].shape)': "tests/data/test_segment_items.py (a seg batch's masks and rows)",
    'TimmBackbone("resnet18", out_indices=(2, 3, 4)': "tests/models/test_timm_backbone.py, test_own_network.py",
    "v3_loss = YOLOv3Loss(": "tests/losses (both losses, their parts and gradients)",
    'run = read_results("runs/train")': "tests/test_notebooks.py, tests/test_viz.py, tests/train/test_compare.py",
    'theirs = yolokit.load("yolo26n.pt")': "tests/interop/test_yolo26_interop.py (the checkpoint, both decodes)",
}


def _is_extended(code: str) -> bool:
    return any(key in code for key in EXTENDED)


def shorter(code: str) -> str:
    for pattern, replacement in SHORTER:
        code = re.sub(pattern, replacement, code)
    return code


def test_the_readme_has_python_blocks_and_each_example_script_a_test():
    assert len(BLOCKS) >= 10
    tested = (ROOT / "tests" / "test_examples.py").read_text()
    for script in sorted((ROOT / "examples").glob("*.py")):
        assert f'"{script.name}"' in tested, f"examples/{script.name} is not run by tests/test_examples.py"


def test_a_block_that_does_not_run_says_why():
    """``<!-- not run: two machines -->`` before a block keeps it out (every such block is listed here,
    with its reason); a bare marker, without a reason, is not one."""
    text = "a\n\n<!-- not run: needs two machines -->\n```python\nx = 1\n```\n\n<!-- not run:  -->\n```python\ny\n```\n"
    assert marked_blocks(text) == [(4, "x = 1\n", "needs two machines"), (9, "y\n", None)]
    for where, _, why in MARKED:
        assert why is None or len(why) > 8, f"{where}: say why the block does not run"


def test_the_substitutions_only_shorten():
    code = 'TrainConfig(epochs=100, imgsz=640, batch=64, devices=4)\ntrain(TrainConfig(resume="r", epochs=120))\n'
    assert shorter(code) == ('TrainConfig(epochs=1, imgsz=64, batch=8, devices=2, workers=0)\n'
                             'train(TrainConfig(resume="r", epochs=2))\n')
    assert shorter("max_epochs=5, batch=16") == "max_epochs=5, batch=16"


# A process that has imported torch and yolokit once, and forks a child per block: the child
# runs the block's file as ``python file.py`` would (``__main__``, its folder first on sys.path,
# a new session, the interpreter's normal exit), without paying the 2 s of ``import torch``
# again for every block. No torch op runs before the fork, so no thread pool is copied.
RUNNER = r"""
import json, os, runpy, sys, traceback
import torch, yolokit, yolokit.accel, yolokit.data, yolokit.interop, yolokit.models, yolokit.predict, yolokit.train
import yolokit.val
for request in sys.stdin:
    script, cwd, log = json.loads(request)
    pid = os.fork()
    if pid == 0:
        os.setsid()
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.chdir(cwd)
        sys.argv, sys.path[0] = [script], cwd
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit:
            raise
        except BaseException:
            traceback.print_exc()
            sys.exit(1)
        sys.exit(0)
    print(json.dumps({"pid": pid}), flush=True)
    print(json.dumps({"code": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}), flush=True)
"""


@pytest.fixture(scope="session")
def runner(pages_staged):
    """``run(script, cwd, timeout) -> (exit code, output)`` through one RUNNER process."""
    import json
    import os
    import select
    import signal

    _, env = pages_staged
    proc = subprocess.Popen([sys.executable, "-c", RUNNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=env, text=True, bufsize=1)

    def reply(timeout: float) -> dict | None:
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else ""
        assert not ready or line, f"the blocks' runner ended (exit code {proc.poll()})"
        return json.loads(line) if line else None

    def run(script: Path, cwd: Path, timeout: float) -> tuple[int | None, str]:
        log = cwd / f"{script.stem}.log"
        proc.stdin.write(json.dumps([str(script), str(cwd), str(log)]) + "\n")
        proc.stdin.flush()
        pid = reply(30)["pid"]
        done = reply(timeout)
        if done is None:                          # past its time: the block and what it started
            os.killpg(pid, signal.SIGKILL)
            reply(30)
        return (done["code"] if done else None), log.read_text(errors="replace")

    yield run
    proc.stdin.close()
    proc.wait(timeout=60)


@pytest.mark.parametrize("where, code", [pytest.param(where, code, id=where,
                                                      marks=[pytest.mark.extended] if _is_extended(code) else [])
                                         for where, code in BLOCKS])
def test_block_runs_as_a_script(pages_staged, runner, tmp_path, where, code):
    files, _ = pages_staged
    work = tmp_path / "work"
    shutil.copytree(files, work)
    script = work / f"block_{where.replace('/', '_').replace('.md:', '_')}.py"
    script.write_text(shorter(code))
    timeout = 900 if _is_extended(code) else 300   # an extended block may compile for minutes on 2 cores
    returncode, output = runner(script, work, timeout=timeout)
    assert returncode is not None, f"{where} did not finish in {timeout} s:\n{output[-3000:]}"
    assert returncode == 0, f"{where}\n{shorter(code)}\n{output[-5000:]}"


@pytest.mark.parametrize("where, code", [(where, code) for where, code in BLOCKS if _is_extended(code)],
                         ids=[where for where, code in BLOCKS if _is_extended(code)])
def test_an_extended_block_names_only_what_exists(where, code):
    import ast
    import dataclasses
    import importlib

    from yolokit.train import TrainConfig

    tree = ast.parse(code, filename=where)
    compile(tree, where, "exec")
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), \
                    f"{where}: {node.module} has no {alias.name}"
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("TrainConfig", "replace"):
                unknown = {k.arg for k in node.keywords if k.arg} - fields
                assert not unknown, f"{where}: TrainConfig has no {sorted(unknown)}"
            if isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
                target = {"yolokit": "yolokit"}.get(node.func.value.id)
                if target:
                    assert hasattr(importlib.import_module(target), node.func.attr), f"{where}: {name}"



def test_the_runner_reports_what_a_script_run_reports(runner, tmp_path):
    """A block that raises, exits with a code, or overruns its time fails its test, as `python block.py` would."""
    cases = {"raises": ("import yolokit\nprint('before')\nraise ValueError('boom')\n", 1, "ValueError: boom"),
             "exits": ("import sys\nprint(__name__)\nsys.exit(3)\n", 3, "__main__"),
             "passes": ("import sys, os\nprint(sys.path[0] == os.getcwd(), sys.argv[0].endswith('passes.py'))\n", 0,
                        "True True")}
    for name, (code, expected, said) in cases.items():
        script = tmp_path / f"{name}.py"
        script.write_text(code)
        returncode, output = runner(script, tmp_path, timeout=60)
        assert returncode == expected and said in output, (name, returncode, output)
    (tmp_path / "sleeps.py").write_text("import time\ntime.sleep(60)\n")
    returncode, _ = runner(tmp_path / "sleeps.py", tmp_path, timeout=1)
    assert returncode is None                             # past its time: killed, reported as not finished
