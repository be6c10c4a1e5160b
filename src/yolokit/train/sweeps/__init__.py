"""Hyperparameter sweeps (``yolokit.tune``, ``yolokit tune``): an Optuna study whose trials are full
training runs.

`space` is what a sweep varies (:class:`SearchSpace`), `study` the study's storage, books and outcome
(:class:`TuneResult`), `tuning` the sweep itself (:func:`tune`). The layout (tests/test_architecture.py):
a sweep sits on top of the run: it may import any module of ``yolokit.train`` and its trackers, and
nothing of the run imports a sweep.
"""

from yolokit.train.sweeps.space import SearchSpace
from yolokit.train.sweeps.study import TuneResult
from yolokit.train.sweeps.tuning import tune

__all__ = ["SearchSpace", "TuneResult", "tune"]
