"""``train()``'s stop: one new exception that says where the run stopped and holds nothing of it."""

from __future__ import annotations

import signal

import pytest

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


@pytest.mark.gpu
def test_an_interrupted_cuda_run_gives_back_its_device_memory(tmp_path):
    """On CUDA, after the stop: ``memory_allocated`` as before the run (nothing of the run held), and the
    cached blocks given back (``memory_reserved`` no higher than before)."""
    import _train_workers as workers
    import torch

    from yolokit.data import make_shapes
    from yolokit.train import TrainConfig, train

    data = make_shapes(tmp_path / "set", n_train=8, n_val=4, imgsz=64)
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")   # the context and cuBLAS's workspace (kept
    torch.cuda.synchronize()                                          # by torch for its stream), before measuring
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    with pytest.raises(Interrupted) as stopped:
        train(TrainConfig(data=str(data), imgsz=64, epochs=2, batch=4, nbs=4, workers=0, plots=False, device="cuda",
                          out=str(tmp_path / "run")), callbacks=[workers._CrashAt(3, "SIGINT")])
    assert stopped.value.steps == 3
    del stopped
    assert torch.cuda.memory_allocated() == allocated
    assert torch.cuda.memory_reserved() <= reserved
