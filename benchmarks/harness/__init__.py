"""The benchmark harness: what every script in ``benchmarks/`` shares.

It lives in the checkout, outside the installed package: yolokit never imports it, and
it is the only code that imports the reference implementation (Ultralytics), in
``reference``, and only when a benchmark runs the reference side. Scripts run as
``python benchmarks/<script>.py`` find it next to them.

- ``timing``: the alternating timer, memory readings (peak, resident set, CPU time) and
  the command / machine / versions header.
- ``inputs``: seeded inputs both sides share (images, targets, head maps, a validation set).
- ``pipeline``: timing batches out of a data loader.
- ``reference``: the reference side of each comparison.
- ``cases`` and ``runner``: the side-by-side cases of ``benchmarks/run.py``.
"""
