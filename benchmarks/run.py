"""yolokit against Ultralytics, case by case, timed in turns (A B A B ...); medians and ratios.

    python benchmarks/run.py                          # all cases; yolokit only without ultralytics
    /path/to/bench-venv/bin/python benchmarks/run.py  # with the reference side
    python benchmarks/run.py --cases nms loss --quick

The same as ``yolokit bench``: the cases live in ``yolokit.bench`` (see its docstring and
BENCHMARKS.md). Ultralytics is imported only when its side runs, from whatever
interpreter runs this script; keep it in a separate environment (``pip install
'yolokit[bench]'`` there).
"""

import sys

from yolokit.bench import main

if __name__ == "__main__":
    sys.exit(main())
