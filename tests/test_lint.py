"""The code is clean under the project's ruff configuration (pyproject.toml: E, F, W, I, B, UP, SIM; 120 columns).

ruff comes with the ``dev`` extra, so this runs wherever the README's command 2 ran.
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    pytest.importorskip("ruff", reason="ruff comes with the dev extra: pip install -e '.[dev]'")
    command = [sys.executable, "-m", "ruff", "check", "--no-cache", "src", "tests", "benchmarks", "examples"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_ruff_is_configured_as_the_project_says():
    tomllib = pytest.importorskip("tomllib")   # Python 3.11+
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    assert config["line-length"] == 120
    assert {"E", "F", "W", "I", "B", "UP", "SIM"} <= set(config["lint"]["select"])
    assert not config["lint"].get("ignore") and not config.get("lint", {}).get("per-file-ignores")
