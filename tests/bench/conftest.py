"""The benchmark harness lives in the checkout (benchmarks/harness), not in the package:
put benchmarks/ on sys.path, as running ``python benchmarks/<script>.py`` does."""

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
