"""Every command line in the README's and the site's ```bash blocks names what exists, and runs.

By default, each ``yolokit`` command (also under ``python -m``, ``torchrun`` or with environment
variables before it) parses with the real argument parser, and a training command's flags make a valid
TrainConfig; each script it runs is in the checkout; any other program is one the page installs or
names (pip, mkdocs, mlflow, ...).

With ``pytest -m extended``, each page's blocks run, in page order, as bash runs them (``set -e``), in
a copy of the folder tests/_pages.py stages, the way a reader follows the page: a later line uses what
an earlier one trained. Runs are shortened by ``SHORTER`` (sizes only: 1 epoch, 64 px, a batch of 8,
2 processes, 2 trials). A block with ``<!-- not run: why -->`` before it does not run; a line that
cannot run on this machine (a GPU, two machines, a server that runs until stopped) or that another
test runs (installs, the suite, the site, examples/) matches a rule of ``NOT_HERE``, which says why.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest
from _pages import NOT_RUN, PAGES

from yolokit.cli import build_parser
from yolokit.train.config import config_from_args

ROOT = Path(__file__).resolve().parents[1]
# programs a page runs that are not yolokit's, and why nothing here runs them
OTHERS = {
    "pip": "installs", "python -m pip": "installs", "python -m venv": "makes an environment",
    "python -m pytest": "the test suite", "mkdocs": "builds the site",
    "mlflow": "MLflow's own command", "wandb": "W&B's own command", "tensorboard": "TensorBoard's own command",
    "weed": "SeaweedFS's own command", "srun": "SLURM", "cat": "writes a file (a here-document)",
    "export": "sets variables", "ruff": "the linter",
}
ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")


def bash_blocks(text: str, *, runnable: bool = False) -> list[tuple[int, str]]:
    """(line number, text) of every ```bash block; ``runnable``: only those without a
    ``<!-- not run: why -->`` line before them."""
    blocks, lines, start = [], text.splitlines(), None
    for i, line in enumerate(lines, 1):
        if start is None and line.strip() == "```bash":
            start = i
        elif start is not None and line.strip() == "```":
            before = next((b.strip() for b in reversed(lines[:start - 1]) if b.strip()), "")
            if not (runnable and NOT_RUN.match(before)):
                blocks.append((start, "\n".join(lines[start:i - 1])))
            start = None
    return blocks


def commands(block: str) -> list[str]:
    """The block's command lines: continuations joined, here-documents and comments left out."""
    out, pending, heredoc = [], "", None
    for line in block.splitlines():
        if heredoc is not None:
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        line = pending + line
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        pending = ""
        code = shlex.split(line, comments=True)
        if not code:
            continue
        if "<<" in line:
            heredoc = line.split("<<", 1)[1].strip().strip("'\"")
        while code:                                   # a && b ; c: each on its own
            cut = next((i for i, w in enumerate(code) if w in ("&&", ";", "||", "|")), len(code))
            if code[:cut]:
                out.append(shlex.join(code[:cut]))
            code = code[cut + 1:]
    return out


COMMANDS = [(f"{page.relative_to(ROOT)}:{line}", cmd) for page in PAGES for line, block in bash_blocks(page.read_text())
            for cmd in commands(block)]


def yolokit_args(words: list[str]) -> list[str] | None:
    """The arguments given to yolokit by this command, or None when it does not run yolokit."""
    while words and ENV.match(words[0]):
        words = words[1:]
    if not words:
        return None
    if words[0] == "yolokit":
        return words[1:]
    if words[0] in ("python", "python3") and words[1:3] == ["-m", "yolokit"]:
        return words[3:]
    if words[0] == "torchrun" and "-m" in words and words[words.index("-m") + 1] == "yolokit":
        return words[words.index("-m") + 2:]
    return None


def test_the_pages_have_commands_of_every_yolokit_command():
    said = {yolokit_args(shlex.split(cmd))[0] for _, cmd in COMMANDS if yolokit_args(shlex.split(cmd))}
    assert said >= {"train", "tune", "val", "predict", "compare", "export", "benchmark", "data", "demo"}, said


@pytest.mark.parametrize("where, cmd", COMMANDS, ids=[f"{w}:{c[:60]}" for w, c in COMMANDS])
def test_a_command_names_what_exists(where, cmd):
    words = shlex.split(cmd)
    args = yolokit_args(words)
    if args is None:
        program = words[[i for i, w in enumerate(words) if not ENV.match(w)][0]:]
        program[0] = {"python3": "python"}.get(Path(program[0]).name, Path(program[0]).name)   # a venv's too
        script = next((w for w in program[1:] if w.endswith(".py")), None)
        if program[0] in ("python", "torchrun") and script:
            assert (ROOT / script).is_file(), f"{where}: {cmd}: there is no {script}"
            return
        name = " ".join(program[:3]) if " ".join(program[:3]) in OTHERS else program[0]
        assert name in OTHERS, f"{where}: {cmd}: {name} is neither yolokit nor a program the pages name"
        return
    args = [a for a in args if a != "..."]            # an elided tail: what is shown must still parse
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parsed = build_parser().parse_args(args)
        except SystemExit as exc:
            raise AssertionError(f"{where}: {cmd}\n{err.getvalue()}") from exc
    if parsed.command == "train":                     # the values make a config (names, ranges, choices)
        parsed.config = None                          # a --config file is the page's own, not in the checkout
        config_from_args(parsed)


def test_a_wrong_flag_fails_here():
    """The check reads the real parser: a flag it does not know, or a value TrainConfig refuses, fails."""
    with pytest.raises(AssertionError, match="unrecognized arguments: --epochz"):
        test_a_command_names_what_exists("x.md:1", "yolokit train --epochz 3")
    with pytest.raises(AssertionError, match="there is no examples/nope.py"):
        test_a_command_names_what_exists("x.md:1", "torchrun --nproc-per-node 2 examples/nope.py")
    with pytest.raises(ValueError, match="precision"):
        test_a_command_names_what_exists("x.md:1", "yolokit train --precision fp8")
    with pytest.raises(AssertionError, match="neither yolokit"):
        test_a_command_names_what_exists("x.md:1", "yolo train data=coco8.yaml")
    assert isinstance(build_parser(), argparse.ArgumentParser)
    assert commands("a \\\n  b  # c\ncat > f <<'EOF'\nx: 1\nEOF\nd && e") == ["a b", "cat '>' f '<<EOF'", "d", "e"]


# ---- the blocks run (pytest -m extended) ----------------------------------------------------------

NOT_HERE = [  # (a pattern the command line matches, why it does not run here)
    (r"\bpip install\b|-m venv\b", "an install: tests/bench/test_packaging.py builds and installs the wheel"),
    (r"-m pytest\b", "the test suite itself: .ci/run runs it"),
    (r"^mkdocs\b|docs/generate\.py", "the site: tests/test_docs.py runs generate.py --check and mkdocs build"),
    (r"\bbenchmarks/", "a benchmark, minutes of measuring: tests/bench runs the scripts' smoke paths"),
    (r"\bexamples/\S+\.py", "tests/test_examples.py runs each example script"),
    (r"--device cuda|^yolokit (predict|val)\b.*--half\b",    # (an export's --half runs on the CPU)
     "needs a CUDA GPU: the prepared GPU command (benchmarks/gpu.py) runs its tests"),
    (r"--nnodes|^srun\b", "two machines"),
    (r"^(mlflow|tensorboard)\b", "a server that runs until stopped: tests/train/test_mlflow_stores.py starts one"),
    (r"^wandb sync\b", "uploads to a W&B account"),
    (r"postgresql://", "a database server"),
]
SHORTER = [  # (pattern, replacement) for every command line: sizes only, never what it does
    (r"--epochs \d+", "--epochs 1"),
    (r"(--resume \S+ --epochs) 1", r"\g<1> 2"),          # a resume that extends the run adds an epoch
    (r"--imgsz \d+", "--imgsz 64"),
    (r"--batch \d+", "--batch 8"),
    (r"--devices \d+", "--devices 2 --workers 0"),      # loader workers in each of 2 processes: only slower
    (r"--nproc-per-node \d+", "--nproc-per-node 2"),
    (r"^torchrun (?!.*--nnodes)", "torchrun --standalone "),   # a free port: other tests run beside it
    (r"--trials \d+", "--trials 2"),
    (r"--time \d+", "--time 0.002"),                    # hours: 7 s
    (r"--save-period-iters \d+", "--save-period-iters 2"),
    (r"(?<![\w.])/shared/", "shared/"),                 # a shared filesystem: a folder here
]
ADDED = {  # flags a line leaves to their defaults, set for the run here (the defaults train for hours)
    "train": [("--epochs", "1"), ("--imgsz", "64"), ("--workers", "0"), ("--no-plots", None)],
    "tune": [("--epochs", "1"), ("--imgsz", "64"), ("--workers", "0")],
    "val": [("--workers", "0")],
    "demo": [("--imgsz", "64")],
}


def not_here(cmd: str) -> str | None:
    """Why ``cmd`` does not run here, or None."""
    words = [w for w in shlex.split(cmd) if not ENV.match(w)]
    line = shlex.join(words) if words else cmd
    return next((why for pattern, why in NOT_HERE if re.search(pattern, line)), None)


def shortened(cmd: str) -> str:
    for pattern, replacement in SHORTER:
        cmd = re.sub(pattern, replacement, cmd)
    args = yolokit_args(shlex.split(cmd))
    resumes = "--resume" in args and args[args.index("--resume") + 1:][:1] != ["auto"] if args else False
    if args and args[0] in ADDED and not resumes:     # --resume auto starts fresh when there is nothing
        for flag, value in ADDED[args[0]]:
            if flag not in args and not (flag == "--no-plots" and "--plots" in args):
                cmd += f" {flag}" + (f" {value}" if value else "")
    return cmd


def script(page: Path) -> str:
    """The page's runnable blocks as one bash script: each command echoed, then run (set -e); a
    command that does not run here echoed with why."""
    out = ["set -e"]
    for line, block in bash_blocks(page.read_text(), runnable=True):
        pending, heredoc = "", None
        for text in block.splitlines():
            if heredoc is not None:
                out.append(text)
                heredoc = None if text.strip() == heredoc else heredoc
                continue
            text = pending + text
            if text.rstrip().endswith("\\"):
                pending = text.rstrip()[:-1] + " "
                continue
            pending = ""
            code = re.sub(r"(^|\s)#.*$", "", text).strip()
            if "<<" in code:
                heredoc = code.split("<<", 1)[1].strip().strip("'\"")
                out.append(code)
                continue
            for cmd in (c.strip() for c in re.split(r"\s+(?:&&|;)\s+", code)):
                if not cmd:
                    continue
                where = f"{page.relative_to(ROOT)}:{line}"
                why = not_here(cmd)
                if why:
                    out.append(f"echo {shlex.quote(f'# {where}: not here ({why}): {cmd}')}")
                else:
                    run = shortened(cmd)
                    out.append(f"echo {shlex.quote(f'$ {where}: {run}')}")
                    out.append(run)
    return "\n".join(out) + "\n"


RUNS = [page for page in PAGES if "\necho '$ " in script(page)]


def written_by_python(text: str) -> dict[str, str]:
    """The files the page's Python blocks write as ``Path("name").write_text("...")`` (a model YAML
    the page builds, then trains from the command line): name -> content."""
    import ast

    files = {}
    for code in re.findall(r"^```python\n(.*?)^```", text, re.S | re.M):
        for node in ast.walk(ast.parse(code)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "write_text"
                    and isinstance(node.func.value, ast.Call) and getattr(node.func.value.func, "id", "") == "Path"
                    and all(isinstance(a, ast.Constant) for a in (*node.func.value.args, *node.args))):
                files[node.func.value.args[0].value] = node.args[0].value
    return files


def test_every_rule_of_not_here_is_used_and_a_gpu_line_is_not_run():
    lines = [cmd for _, cmd in COMMANDS]
    for pattern, why in NOT_HERE:
        assert any(not_here(cmd) == why for cmd in lines), f"no command line matches {pattern!r}: drop the rule"
    assert not_here("yolokit predict clip.mp4 --weights model.pt --device cuda --half").startswith("needs a CUDA")
    assert not_here("yolokit train --data path/to/data.yaml") is None
    assert not_here("yolokit export --weights m.pt --format onnx --half") is None
    assert not_here("MLFLOW_TRACKING_URI=x mlflow ui --port 1") is not None


def test_the_commands_are_shortened_in_size_only():
    assert shortened("yolokit train --model yolov8s --data d.yaml --epochs 100 --imgsz 640 --batch 16") == \
        "yolokit train --model yolov8s --data d.yaml --epochs 1 --imgsz 64 --batch 8 --workers 0 --no-plots"
    assert shortened("yolokit train --resume runs/detect --epochs 200") == \
        "yolokit train --resume runs/detect --epochs 2"
    assert shortened("yolokit train --resume runs/train") == "yolokit train --resume runs/train"
    assert shortened("yolokit train --out runs/big --resume auto") == \
        "yolokit train --out runs/big --resume auto --epochs 1 --imgsz 64 --workers 0 --no-plots"
    assert shortened("torchrun --nproc-per-node 8 -m yolokit train --devices 4 --time 2") == \
        ("torchrun --standalone --nproc-per-node 2 -m yolokit train --devices 2 --workers 0 --time 0.002 --epochs 1 "
         "--imgsz 64 --no-plots")
    assert shortened("yolokit val --weights m.pt --data /shared/d.yaml") == \
        "yolokit val --weights m.pt --data shared/d.yaml --workers 0"
    assert shortened("yolokit predict images/ --weights m.pt") == "yolokit predict images/ --weights m.pt"


def test_a_page_is_one_script_in_page_order():
    text = "```bash\nyolokit train --epochs 3 && pip install x   # c\ncat > s.yaml <<'EOF'\na: 1  # kept\nEOF\n```\n" \
           "\n<!-- not run: needs two machines -->\n```bash\nyolokit train --devices 16\n```\n"
    page = ROOT / "docs" / "_probe.md"
    try:
        page.write_text(text)
        lines = script(page).splitlines()
    finally:
        page.unlink()
    assert lines[0] == "set -e" and lines[2].startswith("yolokit train --epochs 1 --imgsz 64")
    assert "not here (an install" in lines[3] and lines[4:7] == ["cat > s.yaml <<'EOF'", "a: 1  # kept", "EOF"]
    assert len(lines) == 7                                # the marked block is left out
    assert written_by_python('```python\nPath("m.yaml").write_text("nc: 2")\nPath(x).write_text("no")\n```\n') == \
        {"m.yaml": "nc: 2"}
    assert "v8-psa.yaml" in written_by_python((ROOT / "docs" / "models.md").read_text())


@pytest.mark.extended
@pytest.mark.parametrize("page", RUNS, ids=[str(p.relative_to(ROOT)) for p in RUNS])
def test_the_page_runs(pages_staged, tmp_path, page):
    import os
    import shutil
    import subprocess
    import sys

    files, env = pages_staged
    work = tmp_path / "work"
    shutil.copytree(files, work)
    text = script(page)
    if re.search(r"^yolokit train (?!.*--resume)", text, re.M):
        shutil.rmtree(work / "runs" / "train")            # the page trains first: its runs/train is its own
    for name, content in written_by_python(page.read_text()).items():
        (work / name).write_text(content)
    (work / "page.sh").write_text(text)
    env = {**env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"}
    done = subprocess.run(["bash", "page.sh"], cwd=work, env=env, capture_output=True, text=True, timeout=1500,
                          start_new_session=True)
    ran = [line for line in done.stdout.splitlines() if line.startswith(("$ ", "# "))]
    assert done.returncode == 0, "\n".join([f"{page.name}: the last command failed", *ran[-3:],
                                            done.stdout[-3000:], done.stderr[-5000:]])
    assert sum(line.startswith("$ ") for line in ran) >= 1
