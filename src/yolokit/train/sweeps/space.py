"""A sweep's search space: which ``TrainConfig`` fields a study varies, and over what.

A YAML file (or a dict) maps field names to what a trial may take. Names are TrainConfig
fields (``lr0``, ``momentum``, ``weight_decay``, ``imgsz``, ``model``, ...) and augmentation
fields, flat as the flags name them (``hsv_h``, ``mosaic``, ``scale``, ...)::

    lr0: {low: 1.0e-4, high: 0.1, log: true}     # a float range, sampled on a log scale
    momentum: {low: 0.6, high: 0.98}             # a float range
    weight_decay: {low: 0.0, high: 0.001, step: 0.0001}
    hsv_s: {low: 0.0, high: 0.9}
    mosaic: {low: 0.0, high: 1.0}
    imgsz: {low: 320, high: 640, step: 32}       # whole numbers, as the field is an int
    model: {choices: [yolov8n, yolov8s]}         # one of these values

A bare list is refused (is ``[0.001, 0.1]`` a range or two choices?). Every bound and choice is
checked against TrainConfig's own rules when the space is read, so a bad one fails before the
first trial, naming the file and the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, get_args, get_type_hints

import yaml

from yolokit.data import AugmentConfig
from yolokit.models import create_model
from yolokit.train.config import AUGMENT_FIELDS, TrainConfig, check_model_name
from yolokit.train.weights import DEFAULT_MODEL

FIXED = {"out", "resume", "tracker"}    # where a trial writes, and to what, is the sweep's business
KEYS = {"low", "high", "step", "log", "choices"}


@dataclass(frozen=True)
class Dimension:
    """One field of the space: a range (``low``, ``high``, optional ``step``, ``log``; whole numbers
    where the field is an int) or ``choices``."""

    name: str
    low: float | None = None
    high: float | None = None
    step: float | None = None
    log: bool = False
    choices: tuple[Any, ...] | None = None
    integer: bool = False

    def suggest(self, trial: Any) -> Any:
        """This dimension's value for an Optuna ``trial``."""
        if self.choices is not None:
            return trial.suggest_categorical(self.name, list(self.choices))
        if self.integer:
            return trial.suggest_int(self.name, self.low, self.high, step=self.step or 1, log=self.log)
        return trial.suggest_float(self.name, self.low, self.high, step=self.step, log=self.log)

    def samples(self) -> list[Any]:
        """Values that show whether TrainConfig takes this dimension: the bounds, one step, every choice."""
        if self.choices is not None:
            return list(self.choices)
        step = self.step if self.step is not None else (1 if self.integer else None)
        return [self.low, self.high] + ([self.low + step] if step is not None and self.low + step <= self.high else [])

    def as_dict(self) -> dict[str, Any]:
        if self.choices is not None:
            return {"choices": list(self.choices)}
        spec = {"low": self.low, "high": self.high}
        return {**spec, **({"step": self.step} if self.step is not None else {}), **({"log": True} if self.log else {})}


class SearchSpace:
    """The dimensions of a sweep, in the order the file gives them.

    Examples:
        >>> space = SearchSpace.from_dict({"lr0": {"low": 1e-4, "high": 0.1, "log": True},
        ...                                "model": {"choices": ["yolov8n", "yolov8s"]}})
        >>> [d.name for d in space.dimensions]
        ['lr0', 'model']
    """

    def __init__(self, dimensions: list[Dimension]):
        self.dimensions = list(dimensions)

    @classmethod
    def load(cls, value: str | Path | Mapping[str, Any] | SearchSpace) -> SearchSpace:
        """A space from a YAML file, a dict or a space."""
        if isinstance(value, SearchSpace):
            return value
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        path = Path(value)
        if not path.is_file():
            raise FileNotFoundError(f"search space file not found: {path}")
        return cls.from_dict(yaml.safe_load(path.read_text()) or {}, source=str(path))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "the search space") -> SearchSpace:
        """A space from ``{field: {low, high[, step][, log]} | {choices: [...]}}``; errors name ``source``."""
        if not isinstance(data, Mapping) or not data:
            raise ValueError(f"{source}: a search space maps TrainConfig fields to ranges or choices, e.g. "
                             "lr0: {low: 1.0e-4, high: 0.1, log: true}")
        known = ({f.name for f in fields(TrainConfig)} - {"augment"}) | AUGMENT_FIELDS
        dims = []
        for name, spec in data.items():
            if name not in known or name in FIXED:
                why = "is set by the sweep itself" if name in FIXED else "is not a TrainConfig or augmentation field"
                raise ValueError(f"{source}: {name!r} {why}")
            dims.append(_dimension(str(name), spec, source))
        return cls(dims)

    def check(self, base: TrainConfig, source: str = "the search space") -> None:
        """Every bound and choice makes a valid config from ``base``, and every field acts; else a ValueError."""
        varied = [d.name for d in self.dimensions if d.name in ("lr0", "momentum")]
        if varied and base.optimizer.lower() == "auto" and "optimizer" not in {d.name for d in self.dimensions}:
            raise ValueError(f"{source} varies {' and '.join(varied)}, but optimizer auto sets its own learning "
                             "rate and momentum: set optimizer SGD or AdamW in the base config")
        for dim in self.dimensions:
            for value in dim.samples():
                try:
                    base.replace(**{dim.name: value})
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"{source}: {dim.name} = {value!r} is not a valid value ({exc})") from None
        samples = {dim.name: dim.samples() for dim in self.dimensions}
        for model in samples.get("model", [base.model or DEFAULT_MODEL]):
            try:
                check_model_name(model)
            except ValueError as exc:
                raise ValueError(f"{source}: model = {model!r} is not a valid value ({exc})") from None
            stride = int(max(create_model(model, num_classes=1).strides))
            for size in samples.get("imgsz", [base.imgsz]):
                if size % stride:
                    raise ValueError(f"{source}: imgsz = {size!r} is not a valid value (imgsz must be a multiple of "
                                     f"{model}'s largest stride, {stride})")

    def suggest(self, trial: Any) -> dict[str, Any]:
        """A trial's value of every dimension (an enqueued trial gets its fixed ones)."""
        return {dim.name: dim.suggest(trial) for dim in self.dimensions}

    def as_dict(self) -> dict[str, Any]:
        return {dim.name: dim.as_dict() for dim in self.dimensions}


def _dimension(name: str, spec: Any, source: str) -> Dimension:
    where = f"{source}: {name}"
    if not isinstance(spec, Mapping):
        raise ValueError(f"{where}: give a range {{low: .., high: ..}} (optionally step, log: true) or "
                         f"{{choices: [...]}}, not {spec!r}")
    unknown = set(spec) - KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)} (known: low, high, step, log, choices)")
    if "choices" in spec:
        choices = spec["choices"]
        if set(spec) != {"choices"} or not isinstance(choices, list) or not choices:
            raise ValueError(f"{where}: choices is a non-empty list, alone (no low/high)")
        if not all(c is None or isinstance(c, (bool, int, float, str)) for c in choices):
            raise ValueError(f"{where}: choices are numbers, strings, booleans or null")
        return Dimension(name, choices=tuple(choices))
    if not {"low", "high"} <= set(spec):
        raise ValueError(f"{where}: a range needs low and high")
    low, high, step, log = spec["low"], spec["high"], spec.get("step"), bool(spec.get("log", False))
    numbers = [v for v in (low, high, step) if v is not None]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in numbers):
        raise ValueError(f"{where}: low, high and step are numbers")
    hints = {**get_type_hints(TrainConfig), **get_type_hints(AugmentConfig)}
    integer = int in (get_args(hints[name]) or (hints[name],)) and float not in (get_args(hints[name]) or ())
    if integer and not all(isinstance(v, int) for v in numbers):
        raise ValueError(f"{where}: {name} is a whole number: low, high and step are too")
    if not low < high:
        raise ValueError(f"{where}: low ({low}) must be below high ({high})")
    if step is not None and (step <= 0 or log):
        raise ValueError(f"{where}: step must be > 0 and cannot go with log")
    if log and low <= 0:
        raise ValueError(f"{where}: a log range needs low > 0")
    return Dimension(name, low, high, step, log, integer=integer)
