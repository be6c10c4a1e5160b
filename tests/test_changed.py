"""``pytest --changed``: the test files picked for a change are those that import what changed."""

from __future__ import annotations

from pathlib import Path

import _changed

TESTS = Path(__file__).resolve().parent
FILES = sorted(TESTS.rglob("test_*.py"))


def _picked(*changes: str) -> set[str] | None:
    picked = _changed.selected(FILES, list(changes))
    return None if picked is None else {str(p.relative_to(TESTS.parent)) for p in picked}


def test_a_module_picks_the_files_that_import_it_directly_or_through_others():
    picked = _picked("src/yolokit/ops/nms.py")
    assert "tests/ops/test_nms.py" in picked                  # imports it
    assert "tests/predict/test_predictor.py" in picked        # through yolokit.predict
    assert "tests/test_viz.py" in picked and "tests/ops/test_anchors.py" not in picked
    assert "tests/test_changed.py" not in picked


def test_a_name_from_a_package_counts_for_the_module_that_defines_it():
    """``from yolokit.data import make_shapes`` uses yolokit/data/sources/shapes.py, not all of yolokit.data."""
    assert "src/yolokit/data/sources/shapes.py" in _changed.uses(TESTS / "train" / "test_step_syncs.py")
    assert "src/yolokit/data/store/shards.py" not in _changed.uses(TESTS / "ops" / "test_nms.py")
    assert "tests/test_cli.py" in _picked("src/yolokit/cli.py")
    assert "tests/train/test_train_shards.py" in _picked("src/yolokit/cli.py")   # python -m yolokit in a subprocess


def test_helpers_conftests_and_the_project_file():
    assert "tests/train/test_train_graphs.py" in _picked("tests/_graph_tape.py")   # a helper it imports
    data = _picked("tests/data/conftest.py")
    assert data and all(p.startswith("tests/data/") for p in data)
    assert _picked("tests/conftest.py") is None and _picked("pyproject.toml") is None   # everything
    pages = {"tests/test_doc_blocks.py", "tests/test_doc_commands.py", "tests/test_docs.py"}
    assert _picked("README.md") == _picked("docs/models.md") == pages
    assert _picked("docs/generate.py") == _picked("mkdocs.yml") == _picked("README.md")  # not every test of yolokit
    assert _picked("examples/custom_loop.py") == {"tests/test_examples.py"}


def test_what_git_says_changed(tmp_path):
    assert all(not p.startswith("/") for p in _changed.changed_files("HEAD"))


def test_the_quick_loop_touches_every_package():
    """``pytest -m quick`` (tests/_changed.py QUICK) uses a module of every subpackage, the CLI and viz; every
    entry names a test file that exists."""
    import yolokit

    files = {TESTS.parent / entry.split("::")[0] for entry in _changed.QUICK}
    assert all(f.is_file() for f in files), [str(f) for f in files if not f.is_file()]
    used = set().union(*(_changed.uses(f) for f in files))
    homes = [f"src/yolokit/{p}/" for p in yolokit.SUBPACKAGES if p != "viz"] + ["src/yolokit/viz.py",
                                                                                "src/yolokit/cli.py"]
    assert [h for h in homes if not any(u.startswith(h) for u in used)] == []
