"""``python -m yolokit`` is the ``yolokit`` command (``torchrun -m yolokit train ...`` uses it)."""

import sys

from yolokit.cli import main

sys.exit(main())
