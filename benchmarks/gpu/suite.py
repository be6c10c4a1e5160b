"""The checkout's ``gpu``-marked tests (``pytest -m gpu -q``), run as a subprocess before any measurement."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from gpu.common import Clock, Row, Settings

ROOT = Path(__file__).resolve().parents[2]
COUNTS = r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)"


def gpu_tests(s: Settings, clock: Clock) -> list[Row]:
    """Passed and failed counts of ``pytest -m gpu -q``, with its summary line (on the CPU every test skips)."""
    # only the files that mark tests gpu are collected: the same tests, without importing the whole suite
    files = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").rglob("test_*.py") if "mark.gpu" in f.read_text())
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-n", "0", "-p", "no:cacheprovider",   # one process
           *(files or ["tests"])]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=clock.cap_s)
        output, note = done.stdout + done.stderr, ""
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        note = f"timed out after {clock.cap_s:.0f} s; "
    summary = next((line.strip("= ") for line in reversed(output.splitlines()) if re.search(COUNTS, line)), "")
    counts: dict[str, int] = {}
    for n, kind in re.findall(COUNTS, summary):
        counts[kind.rstrip("s") if kind.startswith("error") else kind] = int(n)
    for line in output.splitlines():
        if line.startswith(("FAILED", "ERROR")):
            print(f"  {line}")
    print(f"  {note}{summary or output[-500:]}", flush=True)
    bad = counts.get("failed", 0) + counts.get("error", 0) + bool(note or not summary)
    return [Row("tests", "pytest -m gpu: passed", float(counts.get("passed", 0)),
                target=(">=", 1) if s.cuda else None, note=note + summary, data=counts),
            Row("tests", "pytest -m gpu: failed or errors", float(bad), target=("<=", 0),
                note=f"{counts.get('skipped', 0)} skipped")]
