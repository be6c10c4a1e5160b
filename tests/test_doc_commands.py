"""Every command line in the README's and the site's ```bash blocks names what exists: each ``yolokit``
command (also under ``python -m``, ``torchrun`` or with environment variables before it) parses with the
real argument parser, and a training command's flags make a valid TrainConfig; each script it runs is in
the checkout; any other program is one the page installs or names (pip, mkdocs, mlflow, ...).

What the commands do when run is the business of the tests of each command (tests/test_cli.py and the
tests the pages' Python blocks stand beside, tests/test_doc_blocks.py).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from yolokit.cli import build_parser
from yolokit.train.config import config_from_args

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# programs a page runs that are not yolokit's, and why nothing here runs them
OTHERS = {
    "pip": "installs", "python -m pip": "installs", "python -m venv": "makes an environment",
    "python -m pytest": "the test suite", "mkdocs": "builds the site",
    "mlflow": "MLflow's own command", "wandb": "W&B's own command", "tensorboard": "TensorBoard's own command",
    "weed": "SeaweedFS's own command", "srun": "SLURM", "cat": "writes a file (a here-document)",
    "export": "sets variables", "ruff": "the linter",
}
ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")


def bash_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, text) of every ```bash block."""
    blocks, lines, start = [], text.splitlines(), None
    for i, line in enumerate(lines, 1):
        if start is None and line.strip() == "```bash":
            start = i
        elif start is not None and line.strip() == "```":
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
    assert said >= {"train", "tune", "val", "predict", "compare", "export", "data", "demo"}, said


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
