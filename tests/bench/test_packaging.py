"""The library never ships or imports the benchmarks: no module of src/yolokit imports the
reference implementation or the harness, ``yolokit bench`` is gone, and a wheel built from
the project holds the yolokit package only."""

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "yolokit"
FORBIDDEN = ("ultralytics", "harness", "benchmarks", "yolokit.bench")


def imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.append(node.module)
    return names


def test_no_module_of_the_library_imports_the_reference_or_the_benchmarks():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 30 and not (SRC / "bench").exists()
    offending = [(str(f.relative_to(SRC)), name) for f in files for name in imported_modules(f)
                 if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN)]
    assert offending == []


def test_there_is_no_bench_command(capsys):
    from yolokit.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--quick"])
    assert exit_.value.code == 2 and "invalid choice: 'bench'" in capsys.readouterr().err
    with pytest.raises(ModuleNotFoundError):
        __import__("yolokit.bench")


def test_a_wheel_of_the_project_holds_only_the_package(tmp_path):
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, tmp_path / name)
    for folder in ("src", "benchmarks"):  # benchmarks/ sits next to the package, as in a checkout
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=ignore)
    code = "import setuptools.build_meta as b, sys; print(b.build_wheel(sys.argv[1]))"
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "dist")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    wheel = tmp_path / "dist" / done.stdout.split()[-1]
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"yolokit", wheel.name.split("-py")[0] + ".dist-info"}, tops
    assert "yolokit/cli.py" in names and not any(n.startswith("yolokit/bench/") for n in names)
    assert {"yolokit/models/cfg/yolo11.yaml", "yolokit/models/cfg/yolov8.yaml"} <= set(names)  # model YAMLs ship
    # what PyPI shows: the license as an SPDX expression (PEP 639; setuptools warned at every install that
    # the TOML table stops working after 2027-02-18), its file, and where the documentation and source are
    info = wheel.name.split("-py")[0] + ".dist-info"
    metadata = zipfile.ZipFile(wheel).read(f"{info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
    assert f"{info}/licenses/LICENSE" in names
    assert "Project-URL: Documentation, https://" in metadata and "Project-URL: Source, https://" in metadata
    assert "License classifiers are deprecated" not in done.stderr and "project.license` as a TOML table" not in \
        done.stderr
