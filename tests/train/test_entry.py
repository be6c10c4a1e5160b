"""``train()``'s stop: one new exception that says where the run stopped and holds nothing of it."""

from __future__ import annotations

import signal

from yolokit.accel import Interrupted
from yolokit.train.entry import stopped


def _raised_during(first: BaseException, second: BaseException) -> BaseException:
    """``second`` raised while ``first`` was handled (Python chains it as ``__context__``)."""
    try:
        try:
            raise first
        except BaseException:
            raise second from None
    except BaseException as exc:
        return exc


def test_a_saved_stop_names_the_resume_in_python():
    first = Interrupted(signal.SIGINT)
    first.run_dir, first.steps, first.reported = "runs/long", 52, True
    stop = stopped(_raised_during(KeyboardInterrupt(), first))
    assert str(stop) == ('stopped by SIGINT after 52 optimizer steps, saved in runs/long; resume with '
                         'train(TrainConfig(resume="runs/long"))')
    assert stop is not first and stop.__traceback__ is None and stop.__context__ is None
    assert (stop.run_dir, stop.steps, stop.reported, stop.exit_code) == ("runs/long", 52, True, 130)


def test_a_second_signal_during_the_save_says_the_stop_was_at_once():
    """The save cut short: nothing says where last.pt is; the signal is the first one's."""
    first = Interrupted(signal.SIGTERM)
    stop = stopped(_raised_during(first, KeyboardInterrupt()))
    assert str(stop) == "stopped by SIGTERM (again during the stop: at once)" and stop.exit_code == 143
    assert stop.run_dir is None and stop.__context__ is None


def test_a_second_signal_after_the_save_keeps_where_it_was_saved():
    first = Interrupted(signal.SIGINT)
    first.run_dir, first.steps = "runs/b", 3
    stop = stopped(_raised_during(first, KeyboardInterrupt()))
    assert str(stop).startswith("stopped by SIGINT after 3 optimizer steps, saved in runs/b")


def test_plain_ctrl_c_before_the_loop():
    """Python's own KeyboardInterrupt (during setup: nothing saved)."""
    stop = stopped(KeyboardInterrupt())
    assert str(stop) == "stopped by SIGINT" and stop.run_dir is None and not stop.reported
