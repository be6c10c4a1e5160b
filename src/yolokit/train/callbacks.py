"""Training callbacks: the console (a progress bar, in a terminal or a notebook), a CSV log and end-of-run plots
(trackers: ``yolokit.train.trackers``).

A callback receives plain values (numbers, dicts, arrays), never the trainer, so each
one can be tested and reused on its own. The trainer prints nothing itself: what a run
reports goes through these hooks, and ``ProgressBar`` is the one that writes to the
console. The trainer calls, in order: ``on_setup_end`` (what was built) and
``on_train_start``, then per epoch ``on_epoch_start`` / ``on_batch_end`` (and ``on_log`` at the
loss meter's read points) ... / ``on_validation_end`` / ``on_epoch_end`` (with the results row),
``on_early_stop`` when patience runs out, ``on_interrupt`` on Ctrl-C / SIGTERM, ``on_export``
(the final weights, when training finished), then ``on_train_end`` (always, last).

Callbacks run on rank 0 only when several processes train: the console, the files and the
trackers are written once. A callback whose class sets ``all_ranks = True`` runs on every
rank (each sees its own rank's batches; ``on_epoch_end`` rows are the same everywhere).

The console (``ProgressBar``), in a terminal: a two-line header (the run, then its config file and
the fields set), one tqdm bar per epoch on stderr, the validation line, and early stop / interrupt /
results lines on stdout. In a Jupyter kernel the bar is the one ``tqdm.auto`` would choose: a widget
when ipywidgets is installed, else text on stdout redrawn at most once a second and about ten times an
epoch (a notebook run headless stores a few KB per epoch), and the interrupt's line is the exception ``train()`` raises,
which a notebook shows as one line. ``TrainConfig(verbose=False)`` (``yolokit train --quiet``): one
line per epoch (its losses, the validation metrics, its seconds) and the final metrics, nothing else.
"""

from __future__ import annotations

import csv
import io
import multiprocessing
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from yolokit.train.files import write_text
from yolokit.train.plots import results_plot, validation_plots


def call_hook(callbacks: Sequence[Callback], hook: str, *args: Any) -> None:
    """Calls ``hook`` of every callback, in order."""
    for cb in callbacks:
        getattr(cb, hook)(*args)


class Callback:
    """No-op hooks; subclasses override what they need.

    ``all_ranks``: run on every process of a multi-process run (default: rank 0 only).
    """

    all_ranks: bool = False

    def on_setup_end(self, summary: dict[str, Any]) -> None:
        """What setup built: ``model``, ``data``, ``classes``, ``world``, ``device``, ``batch``,
        ``per_process``, ``accumulate``, ``step_batch``, ``optimizer``, ``lr0``, ``precision``,
        ``layout``, ``sync_bn``, ``workers``, ``threads`` (torch's CPU threads),
        ``config`` (YAML text), ``config_file`` (its path in the run
        folder), ``changed`` (the fields set away from their defaults, one line), ``notes`` (lines from the batch
        finder, pretrained weights and resume) and ``shard_cache`` (data from remote shards: a callable
        that says what their local cache holds against its cap, "1.2G/25.0G"; false otherwise)."""

    def on_train_start(self, run_dir: Path, config: dict[str, Any]) -> None: ...

    def on_epoch_start(self, epoch: int, epochs: int, batches: int) -> None: ...

    def on_batch_end(self, losses: dict[str, float], images: int, memory_gb: float, data_share: float) -> None:
        """After a loader batch: the running mean of each loss part over the epoch's finite batches
        (as of the last device read, every few batches), the batch's images, the memory in use
        (device memory reserved on CUDA, the process's resident memory on the CPU) and the share
        of the epoch's time so far spent waiting for the loader, in [0, 1]."""

    def on_log(self, step: int, values: dict[str, float]) -> None:
        """At the loss meter's read points (every batch on the CPU, every 16 on a GPU), at most once per
        optimizer step: ``step`` (optimizer steps taken in the run) and ``values``: ``step/<part>``, the
        mean loss parts of this rank's batches since the previous call, and ``step/lr`` (named apart
        from the epoch rows' ``train/<part>`` and ``lr``, which trackers log at the epoch's last step)."""

    def on_epoch_end(self, row: dict[str, float]) -> None: ...

    def on_validation_end(self, result: Any, samples: Sequence[tuple[np.ndarray, Any, Any]],
                          names: Sequence[str]) -> None:
        """After a validation: its ``EvalResult``, (image, predictions, ground truth) samples, class names."""

    def on_early_stop(self, epoch: int, patience: int) -> None:
        """Training stops after ``epoch`` (0-based): no improvement for ``patience`` validations."""

    def on_interrupt(self, steps: int, run_dir: Path) -> None:
        """Ctrl-C or SIGTERM: ``last.pt`` in ``run_dir`` holds the last of ``steps`` optimizer steps."""

    def on_time_up(self, steps: int, run_dir: Path, hours: float, metrics: dict[str, float] | None) -> None:
        """The ``time`` budget ran out: the run stopped after ``steps`` optimizer steps, validated (``metrics``
        when it stopped mid-epoch; at an epoch's end ``on_epoch_end`` had them) and saved."""

    def on_export(self, weights: Path) -> None:
        """The run finished and its final inference weights are at ``weights``."""

    def on_train_end(self) -> None:
        """The last hook, however the run ended (finished, interrupted or failed)."""


GPU_COLUMNS = {"gpu_busy%": "busy {:.0f}%", "gpu_mem_peak_gb": "peak {:.2f} GB", "gpu_temp_c": "max {:.0f} C",
               "gpu_power_w": "{:.0f} W"}   # train.feeding's results columns, as the console shows them
TEXT_BAR_SECONDS = 1.0   # a text bar in a notebook: at most one redraw a second (each is stored),
TEXT_BAR_DRAWS = 10      # and about ten an epoch, however long it is


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel with a notebook front end (not a console: tqdm.auto's test)."""
    if "ipykernel.zmqshell" not in sys.modules or "IPython" not in sys.modules:
        return False
    shell = sys.modules["IPython"].get_ipython()
    name = type(shell).__name__.lower()
    return shell is not None and "qt" not in name and "spyder" not in name


def notebook_bar_class() -> type[tqdm]:
    """The bar class of a notebook: tqdm's widget bar when ipywidgets is installed, else the text bar. The
    text bar in a process the kernel started (a rank ``launch`` forked): a widget speaks through the kernel's
    own connection, which only the kernel may use."""
    if multiprocessing.parent_process() is not None:
        return tqdm
    try:
        from tqdm.notebook import IProgress
        from tqdm.notebook import tqdm as widget_bar
    except ImportError:
        return tqdm
    return widget_bar if IProgress is not None else tqdm


class ProgressBar(Callback):
    """The console: the run header, one tqdm bar per epoch (it/s, images/s, running mean losses,
    memory, the share of time spent waiting for data), the validation line, and early stop /
    interrupt / results lines. At an epoch's end the bar shows the results row's losses.

    Args:
        enabled: False: prints nothing.
        verbose: False: one line per epoch and the final metrics only (no header, no bar).
        notebook: the notebook's bar and lines (see the module); None: when in a Jupyter kernel.
    """

    def __init__(self, enabled: bool = True, *, verbose: bool = True, notebook: bool | None = None):
        self.enabled, self.verbose, self.bar, self.run_dir, self.postfix = enabled, verbose, None, None, {}
        self.notebook = in_notebook() if notebook is None else notebook
        self.bar_class = notebook_bar_class() if self.notebook else tqdm
        self.shard_cache, self.metrics = None, {}

    def _write(self, text: str, *, always: bool = False) -> None:
        if self.enabled and (self.verbose or always):
            self.bar_class.write(text, file=sys.stdout)

    def on_setup_end(self, summary: dict[str, Any]) -> None:
        s = summary
        self._write(f"yolokit train: {s['model']} on {s['data']} ({s['classes']} classes), {s['world']} x "
                    f"{s['device']}, batch {s['batch']} ({s['per_process']} per process) x {s['accumulate']} "
                    f"accumulation = {s['step_batch']} per step, {s['optimizer']} lr {s['lr0']:g}, "
                    f"{s['precision']}, {s['layout']}{', SyncBatchNorm' if s['sync_bn'] else ''}, "
                    f"{s['workers']} loader workers and {s['threads']} torch thread{'s' * (s['threads'] != 1)} "
                    "per process")
        self._write(f"config: {s['config_file']}" + (f" ({s['changed']})" if s.get("changed") else ""))
        for note in s["notes"]:
            self._write(note)
        self.shard_cache = s.get("shard_cache") or None

    def on_train_start(self, run_dir: Path, config: dict[str, Any]) -> None:
        self.run_dir = run_dir

    def on_epoch_start(self, epoch: int, epochs: int, batches: int) -> None:
        self.images, self.start, self.postfix, self.epochs = 0, time.perf_counter(), {}, epochs
        shown = self.enabled and self.verbose
        text = {} if self.bar_class is not tqdm else (   # a text bar in a notebook: each redraw is kept
            dict(file=sys.stdout, mininterval=TEXT_BAR_SECONDS, miniters=max(1, batches // TEXT_BAR_DRAWS),
                 ncols=140) if self.notebook else dict(dynamic_ncols=True))
        self.bar = self.bar_class(total=batches, desc=f"epoch {epoch + 1}/{epochs}", disable=not shown,
                                  leave=True, **text)

    def on_batch_end(self, losses: dict[str, float], images: int, memory_gb: float, data_share: float) -> None:
        self.images += images
        rate = self.images / max(time.perf_counter() - self.start, 1e-9)
        self.postfix = {**{k: f"{v:.3f}" for k, v in losses.items()}, "img_s": f"{rate:.1f}",
                        "data": f"{100 * data_share:.0f}%", "mem": f"{memory_gb:.2f}G"}
        if self.shard_cache:                # remote shards: the local cache of their chunks against its cap
            self.postfix["cache"] = self.shard_cache()
        self.bar.set_postfix(self.postfix, refresh=False)
        self.bar.update(1)

    def on_epoch_end(self, row: dict[str, float]) -> None:
        means = {k.split("/", 1)[1]: f"{v:.3f}" for k, v in row.items() if k.startswith("train/")}
        if self.bar is not None:      # the epoch's means over every process, as results.csv has them
            self.postfix = {**self.postfix, **means, "data": f"{row.get('data%', 0):.0f}%"}
            self.bar.set_postfix(self.postfix, refresh=True)
            self.bar.close()
        if "mAP50" in row:
            self.metrics = {k: row[k] for k in METRICS if k in row}
        val = _metrics_line(row) if "mAP50" in row else ""
        if not self.verbose:          # quiet: the epoch's one line
            losses = " ".join(f"{k} {v}" for k, v in means.items())
            self._write(f"epoch {int(row['epoch'])}/{self.epochs}: {losses}{'  ' + val if val else ''}  "
                        f"{row.get('seconds', 0.0):.1f} s", always=True)
        elif val:
            self._write(f"  val: {val}")
        if row.get("lost_images"):
            self._write(f"  data: {int(row['lost_images'])} images of unreadable shards skipped (named above)")
        gpu = [text.format(row[key]) for key, text in GPU_COLUMNS.items() if key in row]
        if gpu:                       # is the GPU fed? next to data%
            self._write(f"  gpu: {'  '.join(gpu)}  data {row['data%']:.0f}%")

    def on_early_stop(self, epoch: int, patience: int) -> None:
        self._write(f"early stop after epoch {epoch + 1}: no improvement for {patience} validations")

    def on_interrupt(self, steps: int, run_dir: Path) -> None:
        if self.bar is not None:
            self.bar.close()
        if not self.notebook:         # a notebook shows the exception's one line instead
            self._write(f"\ninterrupted after {steps} optimizer steps: resume with `yolokit train --resume "
                        f"{run_dir}`", always=True)

    def on_time_up(self, steps: int, run_dir: Path, hours: float, metrics: dict[str, float] | None) -> None:
        if self.bar is not None:
            self.bar.close()
        if metrics is not None:
            self.metrics = metrics
            self._write(f"\n  val: {_metrics_line(metrics)}")
        self._write(f"time budget of {hours:g} h used after {steps} optimizer steps: continue with "
                    f"`yolokit train --resume {run_dir}`", always=True)

    def on_export(self, weights: Path) -> None:
        final = f": {_metrics_line(self.metrics)}" if self.metrics and not self.verbose else ""
        self._write(f"results in {self.run_dir}{final}", always=True)

    def on_train_end(self) -> None:
        if self.bar is not None:      # a run that failed mid-epoch: the bar's line ends before the error's
            self.bar.close()


METRICS = ("precision", "recall", "mAP50", "mAP50-95", "mask_precision", "mask_recall", "mask_mAP50",
           "mask_mAP50-95")


def _metrics_line(values: dict[str, float]) -> str:
    masks = (f"  mask P {values.get('mask_precision', 0.0):.3f}  mask R {values.get('mask_recall', 0.0):.3f}  "
             f"mask mAP50 {values['mask_mAP50']:.3f}  mask mAP50-95 {values['mask_mAP50-95']:.3f}"
             if "mask_mAP50" in values else "")
    return (f"P {values['precision']:.3f}  R {values['recall']:.3f}  mAP50 {values['mAP50']:.3f}  "
            f"mAP50-95 {values['mAP50-95']:.3f}{masks}")


class CSVLogger(Callback):
    """``results.csv``: one row per epoch; appends on resume. The columns are the file's header
    (from its first row): a row without a column leaves it empty, one with more keys loses them."""

    def __init__(self, path: Path):
        self.path, self.fields = Path(path), None

    def write(self, row: dict[str, Any]) -> None:
        """Appends ``row`` (floats to 6 significant digits)."""
        new = not self.path.exists()
        if self.fields is None:
            if new:
                self.fields = list(row)
            else:
                with self.path.open(newline="") as f:
                    self.fields = next(csv.reader(f), None) or list(row)
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=self.fields, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
        write_text(self.path, text.getvalue(), append=True)

    def on_epoch_end(self, row: dict[str, float]) -> None:
        self.write(row)


class Plotter(Callback):
    """End-of-run charts (matplotlib): ``results.png`` (losses and metrics per epoch) and, from the
    last validation, PR / F1 / P / R curves, the confusion matrix and labels vs predictions."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.rows, self.result, self.samples, self.names = run_dir, [], None, [], []

    def on_epoch_end(self, row: dict[str, float]) -> None:
        self.rows.append(dict(row))

    def on_validation_end(self, result: Any, samples: Sequence[tuple[np.ndarray, Any, Any]],
                          names: Sequence[str]) -> None:
        self.result, self.samples, self.names = result, list(samples), list(names)

    def on_train_end(self) -> None:
        try:
            results_plot(self.rows, self.run_dir / "results.png")
            if self.result is not None:
                validation_plots(self.result, self.samples, self.names, self.run_dir)
        except Exception as exc:  # a chart must never cost the run its final weights
            warnings.warn(f"plots of {self.run_dir} not drawn: {type(exc).__name__}: {exc}", stacklevel=2)
