"""The documentation site: its generated pages are current, every public name has a docstring and a page,
every page is in the navigation, and ``mkdocs build --strict`` passes (no broken link or reference).

The code blocks of its pages run in tests/test_doc_blocks.py.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


@functools.cache
def _script(name: str):
    """docs/<name>.py as a module (the site's scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(f"docs_{name}", DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _generate():
    return _script("generate")


def _figures():
    return _script("figures")


def test_the_generated_pages_are_current():
    """The API and command-line references are what docs/generate.py writes from the code today."""
    stale = [str(path.relative_to(ROOT)) for path, text in _generate().pages().items()
             if not path.exists() or path.read_text() != text]
    assert not stale, f"out of date (run python docs/generate.py): {stale}"


def test_every_public_name_has_a_page():
    """Each name of ``yolokit.__all__`` and of each subpackage's ``__all__`` is an entry of its reference page."""
    import yolokit

    pages = _generate().public_names()
    assert set(pages) == {"yolokit", *yolokit.SUBPACKAGES}
    shown = {shown for names in pages.values() for shown, _ in names}
    generate = _generate()
    top = [n for n in yolokit.__all__ if n not in yolokit.SUBPACKAGES and n != "__version__"]
    expected = {f"yolokit.{generate.top_level_home(n)}.{n}" if generate.top_level_home(n) else f"yolokit.{n}"
                for n in top}
    index = (DOCS / "reference" / "yolokit.md").read_text()
    assert all(f"| `yolokit.{n}` |" in index for n in top)     # each top-level name links its entry
    for sub in yolokit.SUBPACKAGES:
        expected |= {f"yolokit.{sub}.{n}" for n in importlib.import_module(f"yolokit.{sub}").__all__}
    assert expected <= shown, sorted(expected - shown)
    for page, names in pages.items():
        text = (DOCS / "reference" / f"{page}.md").read_text()
        missing = [path for _, path in names if f"::: {path}\n" not in text]
        assert not missing, f"docs/reference/{page}.md lacks {missing}"
    assert len(shown) >= 134


def test_every_public_name_has_a_docstring():
    """What mkdocstrings renders: the docstring griffe reads from the source, constants included (a string
    right after the assignment)."""
    griffe = pytest.importorskip("griffe")
    package = griffe.load("yolokit", search_paths=[str(ROOT / "src")], resolve_aliases=True,
                          resolve_external=False)
    missing = []
    for names in _generate().public_names().values():
        for shown, path in names:
            obj = package[path.removeprefix("yolokit.")]
            if obj.is_alias:
                obj = obj.final_target
            if obj.docstring is None or not obj.docstring.value.strip():
                missing.append(shown)
    assert not missing, f"public names without a docstring: {missing}"


def _nav_files(nav) -> list[str]:
    out = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        out += _nav_files(value) if isinstance(value, list) else [value]
    return out


def test_every_page_is_in_the_navigation_and_every_guide_in_the_readme():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_files(config["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in [*DOCS.rglob("*.md"), *DOCS.rglob("*.ipynb")])
    assert sorted(nav) == pages, (set(nav) ^ set(pages))
    notebooks = sorted(p.name for p in (ROOT / "examples" / "notebooks").glob("*.ipynb"))
    assert sorted(Path(p).name for p in nav if p.endswith(".ipynb")) == notebooks   # each shown on the site
    assert all((DOCS / p).resolve() == ROOT / "examples" / "notebooks" / Path(p).name for p in nav
               if p.endswith(".ipynb"))                  # the examples' files themselves (links), not copies
    readme = (ROOT / "README.md").read_text()
    guides = [p for p in nav if not p.startswith("reference/") and p != "index.md" and not p.endswith(".ipynb")]
    unlinked = [p for p in guides if f"docs/{p}" not in readme]
    assert not unlinked, f"README.md links no guide for {unlinked}"


def test_the_readme_is_a_front_door():
    """At most about 200 lines, the two Quick start commands as they were, and a link to each guide."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 210
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"```bash\n(.*?)\n```", quick, re.S) == [
        "python3 -m pip install . && yolokit train", 'python3 -m pip install -e ".[dev]" && python3 -m pytest -q']
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).is_file(), f"README.md links {link}, which does not exist"


@pytest.mark.slow
def test_the_site_builds_strict(tmp_path):
    """``mkdocs build --strict``: a broken link or anchor, a page outside the navigation, a reference
    mkdocstrings cannot resolve, or a missing snippet each fail the build (a subprocess: its exit code
    is the point)."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-5000:]
    site = tmp_path / "site"
    assert (site / "index.html").is_file() and (site / "reference" / "cli" / "index.html").is_file()
    accel = (site / "reference" / "accel" / "index.html").read_text()
    assert "Accumulator" in accel and "sync" in accel         # a rendered class with its methods
    assert not (site / "generate.py").exists() and not (site / "figures.py").exists()   # the scripts stay out
    assert not list(site.rglob("*.pyc"))                     # nor their bytecode (docs/__pycache__)
    notebook = (site / "notebooks" / "getting_started" / "index.html").read_text()
    assert "read_results" in notebook and "Interrupt the kernel" in notebook   # the notebook's code and text


def test_the_charts_quote_the_benchmarks():
    """Each bar of the speed guide's charts is read from a measurement BENCHMARKS.md still holds."""
    benchmarks = (ROOT / "BENCHMARKS.md").read_text()
    for chart, bar, value, _, quote in _figures().LEVERS:
        assert quote in benchmarks, f"{chart} / {bar}: BENCHMARKS.md no longer says {quote!r}"
        assert f"{value:g}" in quote.replace(",", ""), (bar, value, quote)


def test_every_picture_is_shown_and_every_shown_picture_exists():
    shown = {m for page in DOCS.rglob("*.md") for m in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", page.read_text())}
    made = {f"images/{p.name}" for p in (DOCS / "images").glob("*.png")}
    assert made == {"images/curves.png", "images/levers.png", "images/augment.png", "images/predictions.png"}
    assert {Path(s).name for s in shown} == {Path(m).name for m in made}


def test_the_figures_script_draws_from_runs(tmp_path):
    """On a small set and a parity folder (two seeds a side): the charts, both augmentation paths, the curves of
    every run."""
    import json

    from yolokit.data import make_shapes

    figures = _figures()
    data = make_shapes(tmp_path / "set", n_train=8, n_val=4, imgsz=64)
    made = [figures.levers(tmp_path), figures.augment(tmp_path, str(data), imgsz=64, n=4)]
    runs = [{"side": side, "seed": seed, "curve": {"box50": [0.1 + seed, 0.3], "box": [0.05, 0.2 + seed / 10]}}
            for side in ("yolokit", "reference") for seed in (0, 1)]
    (tmp_path / "parity").mkdir()
    (tmp_path / "parity" / "runs.json").write_text(json.dumps(runs))
    made.append(figures.curves(tmp_path / "parity", tmp_path))
    import cv2

    shapes = {p.name: cv2.imread(str(p)).shape for p in made}
    assert shapes["augment.png"] == (2 * (28 + 64), 4 * 64 + 3 * 4, 3)    # two labelled rows of 4 images
    assert all(h > 200 and w > 400 for name, (h, w, _) in shapes.items() if name != "augment.png"), shapes
