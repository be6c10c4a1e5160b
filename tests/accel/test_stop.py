"""Stops on a signal: a cleanup a second Ctrl-C does not cut short; a stop a notebook shows as one line."""

from __future__ import annotations

import signal

import pytest

from yolokit.accel.stop import GracefulStop, Interrupted, deferred_signals


def test_a_signal_inside_a_deferred_section_waits_for_its_end():
    done = []
    before = signal.getsignal(signal.SIGINT)    # Python's handler, or SIG_IGN in a job started in the background
    with pytest.raises(Interrupted) as stopped, deferred_signals():
        signal.raise_signal(signal.SIGINT)
        done.append("after the signal")           # not cut short
        signal.raise_signal(signal.SIGTERM)
        done.append("to the end")
    assert done == ["after the signal", "to the end"]
    assert stopped.value.signum == signal.SIGINT and stopped.value.exit_code == 130   # the first signal
    assert signal.getsignal(signal.SIGINT) is before                                    # handlers back


def test_a_deferred_section_left_by_an_exception_keeps_that_exception():
    """A cleanup during a stop: the second Ctrl-C asked for what is already happening."""
    with pytest.raises(ValueError, match="in flight"), deferred_signals():
        signal.raise_signal(signal.SIGINT)
        raise ValueError("in flight")
    with deferred_signals():                          # nothing received: nothing raised
        pass


def test_graceful_stop_raises_at_once_outside_deferred_and_after_a_deferred_section():
    stop = GracefulStop()
    with stop, pytest.raises(Interrupted):
        signal.raise_signal(signal.SIGINT)
    assert stop.received == signal.SIGINT
    stop, seen = GracefulStop(), []
    with stop, pytest.raises(Interrupted), stop.deferred():
        signal.raise_signal(signal.SIGTERM)
        seen.append("step finished")
    assert seen == ["step finished"] and stop.received == signal.SIGTERM


def test_a_stop_renders_as_one_line_in_ipython():
    stop = Interrupted(signal.SIGINT, 'stopped by SIGINT after 4 optimizer steps; resume with train(...)')
    assert stop._render_traceback_() == ["Interrupted: stopped by SIGINT after 4 optimizer steps; resume with "
                                         "train(...)"]
    assert str(Interrupted(signal.SIGTERM)) == "SIGTERM received" and Interrupted().run_dir is None
