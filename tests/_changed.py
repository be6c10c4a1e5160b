"""``pytest --changed [REF]``: the test files that use what changed since REF (default HEAD, the work tree).

A test file uses a yolokit module when it imports it, or a name defined in it, directly or through the
modules it uses (a name re-exported by a package's ``__init__`` counts for the module that defines it, not
for the whole package), or through the helpers in tests/ it imports. A test that starts ``python -m
yolokit`` or ``yolokit.cli`` in a subprocess uses ``yolokit.cli``. A changed test file, helper or conftest
selects the files that use it, and a package's ``__init__`` the files that import through it; a change to
pyproject.toml or to tests/conftest.py selects everything; one to README.md, mkdocs.yml or docs/ the tests
of the pages, and one to examples/ tests/test_examples.py. Read statically (``ast``), nothing imported: a
selection in under a second, for the quick loop (docs/contributing.md); CI runs everything.
"""

from __future__ import annotations

import ast
import subprocess
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC, TESTS = ROOT / "src", ROOT / "tests"
EVERYTHING = {"pyproject.toml", "tests/conftest.py"}
# The quick loop (`pytest -m quick`, docs/contributing.md): under a minute that touches every package once,
# by the tests (file, or file::test prefix) below; tests/test_changed.py checks that each package is used
# (tests/conftest.py marks them).
QUICK = (
    "tests/accel/test_accumulation.py", "tests/accel/test_amp.py", "tests/accel/test_checkpointing.py",
    "tests/accel/test_oom.py", "tests/data/test_loader.py", "tests/data/test_mosaic.py",
    "tests/data/test_transforms.py", "tests/data/test_device_augment.py", "tests/interop/test_native.py",
    "tests/interop/test_security.py", "tests/losses/test_assigners.py", "tests/losses/test_yolov8_loss.py",
    "tests/losses/test_yolov3_loss.py", "tests/models/test_detector.py", "tests/models/test_layers.py",
    "tests/ops/test_boxes.py", "tests/ops/test_nms.py", "tests/predict/test_results.py",
    "tests/predict/test_sources.py", "tests/train/test_checkpoint.py", "tests/train/test_config.py",
    "tests/train/test_ema.py", "tests/train/test_plan.py", "tests/train/test_step.py",
    "tests/train/test_trainer.py::test_two_epochs_write_the_run_folder",
    "tests/train/test_trainer.py::test_resume_is_exact",
    "tests/val/test_cocoeval.py", "tests/val/test_metrics.py", "tests/test_viz.py",
    "tests/test_cli.py::test_train_val_predict_export_on_a_tiny_set",
)

DOC_TESTS = ("tests/test_doc_blocks.py", "tests/test_doc_commands.py", "tests/test_docs.py")
CLI_MARKS = ('"-m", "yolokit"', "'-m', 'yolokit'", '"yolokit.cli"', "yolokit.__main__", 'which("yolokit")')


def changed_files(ref: str = "HEAD") -> list[str]:
    """Paths (relative to the checkout) changed since ``ref``, staged or not, and untracked files."""
    def git(*args: str) -> list[str]:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        return [line for line in out.splitlines() if line]

    return sorted(set(git("diff", "--name-only", ref)) | set(git("ls-files", "--others", "--exclude-standard")))


def _module_file(name: str) -> Path | None:
    """The source file of a yolokit module or package (None: not ours, or not a module)."""
    base = SRC.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


@cache
def _defines(path: Path) -> dict[str, str]:
    """Names a package ``__init__`` (or module) re-exports: name -> the module it takes it from."""
    out = {}
    for node in _tree(path).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("yolokit"):
            for alias in node.names:
                out[alias.asname or alias.name] = node.module
    return out


def _resolve(module: str, names: list[str], inits: set[Path]) -> set[str]:
    """The yolokit modules ``from module import names`` uses: submodules by name, re-exported names at the
    module that defines them, the module itself for the rest. The package ``__init__`` files passed through
    go to ``inits`` (used, but what they import is not followed)."""
    found = set()
    path = _module_file(module)
    if path is None:
        return found
    for name in names:
        if path.name == "__init__.py":
            inits.add(path)
        if _module_file(f"{module}.{name}") is not None:
            found.add(f"{module}.{name}")
        elif path.name == "__init__.py" and name in _defines(path):
            found |= _resolve(_defines(path)[name], [name], inits) or {_defines(path)[name]}
        else:
            found.add(module)
    return found


@cache
def _direct(path: Path) -> tuple[set[str], set[Path], set[Path]]:
    """(yolokit modules, package ``__init__`` files passed through, test helper files) that one file imports
    at any depth of its code."""
    modules, inits, helpers = set(), set(), set()
    text = path.read_text(encoding="utf-8")
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            items = [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            items = [(node.module, [alias.name for alias in node.names])]
        else:
            continue
        for module, names in items:
            if module == "yolokit" or module.startswith("yolokit."):
                modules |= _resolve(module, names, inits) if names else {module}
                continue
            parts = module.split(".")
            for helper in (TESTS.joinpath(*parts).with_suffix(".py"), ROOT.joinpath(*parts).with_suffix(".py"),
                           path.parent.joinpath(*parts).with_suffix(".py"), TESTS / "train" / f"{parts[-1]}.py"):
                if helper.is_file() and helper != path:
                    helpers.add(helper)
                    break
    if path != Path(__file__).resolve() and any(mark in text for mark in CLI_MARKS):   # (not these marks)
        modules.add("yolokit.cli")
    return modules, inits, helpers


@cache
def uses(path: Path) -> frozenset[str]:
    """Every file (relative to the checkout) ``path`` uses: yolokit modules' files and test helpers, closed
    over what each of those uses."""
    seen: set[Path] = set()
    passed: set[Path] = set()
    frontier = [path]
    while frontier:
        current = frontier.pop()
        if current in seen:
            continue
        seen.add(current)
        modules, inits, helpers = _direct(current)
        passed |= inits
        frontier += [f for m in modules if (f := _module_file(m)) is not None] + sorted(helpers)
    return frozenset(str(p.relative_to(ROOT)) for p in seen | passed)


def _by_path(change: str) -> set[str]:
    """The test files a change that no test imports selects: a page of the site or the README (its blocks
    run, its pages build), an example script."""
    if change in ("README.md", "mkdocs.yml") or change.startswith("docs/"):
        return set(DOC_TESTS)
    if change.startswith("examples/"):
        return {"tests/test_examples.py"}
    return set()


def selected(test_files: list[Path], changes: list[str]) -> list[Path] | None:
    """The test files among ``test_files`` that use a changed file (None: every one)."""
    by_path = set().union(*map(_by_path, changes)) if changes else set()
    changes = [c for c in changes if c.endswith(".py") and not _by_path(c) or c in EVERYTHING]
    if any(c in EVERYTHING or c.endswith("/conftest.py") and c.count("/") == 1 for c in changes):
        return None
    picked = []
    for path in test_files:
        used = uses(path)
        conftests = {str(p.relative_to(ROOT)) for p in path.parents if (p / "conftest.py").is_file()
                     and TESTS in (p, *p.parents)}
        if str(path.relative_to(ROOT)) in by_path or any(c in used or c.removesuffix("/conftest.py") in conftests
                                                         for c in changes):
            picked.append(path)
    return picked
