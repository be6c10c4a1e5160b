"""yolokit against Ultralytics, case by case, timed in turns (A B A B ...); medians and ratios.

    python benchmarks/run.py                          # all cases; yolokit only without ultralytics
    /path/to/bench-venv/bin/python benchmarks/run.py  # with the reference side
    python benchmarks/run.py --cases nms loss --quick

The cases live in ``benchmarks/harness/cases.py`` (see ``harness/runner.py`` and
BENCHMARKS.md). Ultralytics is imported only when its side runs, from whatever
interpreter runs this script; keep it in a separate environment (``pip install
'yolokit[bench]'`` there).
"""

import sys

from harness.runner import main

if __name__ == "__main__":
    sys.exit(main())
