"""Tests of the benchmark harness (benchmarks/harness): the alternating timer, memory and
CPU readings, the shared inputs, batch timing, and a quick run of cheap cases without the
reference (ultralytics is never imported here)."""

import sys
import time

import numpy as np
import pytest
import torch
from harness import inputs
from harness.cases import CASES
from harness.pipeline import epochs, time_batches
from harness.runner import Result, main, run
from harness.timing import Timed, allocations, alternate, cpu_seconds, header, peak_memory, resident_bytes

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc readings are Linux only")


def test_alternate_runs_in_turns_and_counts_units():
    order = []
    fns = [lambda: order.append("a"), lambda: order.append("b") or Timed(2.0, 4)]
    runs = alternate(fns, warmup=1, repeats=3, inner=2)
    assert order == ["a", "b"] + ["a", "a", "b", "b"] * 3
    assert len(runs[0]) == 3 and all(t >= 0 for t in runs[0])
    assert runs[1] == [0.5, 0.5, 0.5]  # two calls of (2 s, 4 units) per run: 4 s over 8 units


def test_alternate_times_a_run_as_one_block_per_call():
    runs = alternate([lambda: time.sleep(0.01)], warmup=0, repeats=2, inner=3, device="cpu")
    assert all(0.009 < t < 0.2 for t in runs[0])  # seconds per call, not per run of 3


def test_result_ratio_and_units():
    r = Result("data", "x", "img/s", ours=[0.01, 0.02, 0.03], theirs=[0.04, 0.04, 0.05])
    assert r.ratio == pytest.approx(0.5)
    assert r.value(r.ours) == pytest.approx(50.0)  # images per second from seconds per image
    assert Result("nms", "y", "ms", ours=[0.002]).value([0.002]) == pytest.approx(2.0)
    assert Result("nms", "y", "ms", ours=[0.002]).ratio is None


@linux_only
def test_peak_memory_sees_a_large_temporary():
    extra = peak_memory(lambda: torch.ones(64, 2**20).sum())  # 256 MiB, freed at once
    assert extra is None or extra > 200 * 2**20
    whole = peak_memory(lambda: torch.ones(64, 2**20).sum(), extra=False)  # what the process held included
    assert whole is None or whole > extra + 20 * 2**20


@linux_only
def test_allocations_counts_each_allocation_once_and_the_peak():
    def fn():
        a = torch.empty(1000, dtype=torch.uint8)
        b = torch.cat([a, a])          # inside an op: its memory column would count it twice, with cat's own
        del a
        c = torch.empty(500, dtype=torch.uint8)
        del c
        return b

    out, total, peak = allocations(fn)
    assert out.numel() == 2000 and total == 3500 and peak == 3000


def test_resident_set_and_cpu_time():
    now, peak = resident_bytes(), resident_bytes(peak=True)
    assert 20 * 2**20 < now <= peak  # a process with torch loaded holds tens of MiB at least
    before = cpu_seconds()
    end = time.process_time() + 0.2
    while time.process_time() < end:  # busy for 0.2 s of CPU
        pass
    assert cpu_seconds() - before >= 0.15


def test_header_names_command_machine_and_versions():
    lines = header({"reference": "none"}).splitlines()
    assert [line.split(":")[0] for line in lines] == ["command", "machine", "versions"]
    assert "torch " + torch.__version__ in lines[2] and lines[2].endswith("reference none")


def test_time_batches_counts_images_after_warmup_across_epochs():
    loader = [{"images": torch.zeros(2, 3, 4, 4)}, {"img": torch.zeros(3, 3, 4, 4)}]  # one epoch: 2 batches
    timed = time_batches(epochs(loader), count=3, warmup=1, key=None)
    assert timed.units == 3 + 2 + 3 and timed.seconds >= 0  # batches 2, 3 (next epoch), 4 after one warm-up
    assert timed.cpu_seconds is not None and timed.cpu_seconds >= 0


def test_inputs_are_reproducible_and_shaped():
    a, b = inputs.random_targets(4, 3, 320), inputs.random_targets(4, 3, 320)
    assert torch.equal(a, b) and a.shape == (12, 6)
    assert ((a[:, 2:4] >= 0) & (a[:, 4:6] <= 320) & (a[:, 4:6] > a[:, 2:4])).all()
    maps = inputs.v8_maps(2, 64)
    assert [tuple(m.shape) for m in maps] == [(2, 144, 8, 8), (2, 144, 4, 4), (2, 144, 2, 2)]
    data = inputs.evaluation_set(5, max_det=20)
    for d in data:
        assert len(d["boxes"]) <= 20 and np.all(np.diff(d["scores"]) <= 0)  # ranked as NMS returns them


def test_quick_run_without_reference():
    results = run(["nms", "eval"], quick=True, reference=False, repeats=1, warmup=0, echo=None)
    assert [r.case for r in results] == ["nms", "nms", "eval", "eval"]  # eval: ours, and pycocotools alone
    assert all(len(r.ours) == 1 and r.ours[0] > 0 and r.theirs == [] and r.ratio is None for r in results)


@pytest.mark.extended
def test_the_train_step_cases_build_and_run_without_reference():
    """The cases that build a model and a trainer's step (they went stale once: an attribute the trainer
    renamed) run one call each."""
    results = run(["train", "yolo26"], quick=True, reference=False, repeats=1, warmup=0, echo=None)
    assert [r.case for r in results] == ["train"] * 4 + ["yolo26"] * 4
    labels = [r.label for r in results]
    assert "yolo26n train step, musgd" in labels and "yolo26n inference, batch 1, 320 px" in labels
    assert all(len(r.ours) == 1 and r.ours[0] > 0 and r.theirs == [] for r in results)


def test_unknown_case_is_an_error(capsys):
    with pytest.raises(ValueError, match="unknown case"):
        run(["nope"], reference=False, echo=None)
    assert set(CASES) == {"train", "inference", "nms", "loss", "data", "eval", "yolo26", "seg"}
    with pytest.raises(SystemExit) as exit_:
        main(["--cases", "nope"])
    assert exit_.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err


def test_the_gpu_pass_step_as_cuda_graphs_records_and_replays(monkeypatch):
    """benchmarks/gpu's TrainStep(graphs=True) (the launch section's cuda_graphs rows) on the CPU stand-in
    for CUDA graphs (tests/_graph_tape.py): two eager steps, a recording, then replays, each an SGD step."""
    from gpu.common import Settings, TrainStep

    from tests._graph_tape import TapeBackend
    from yolokit.accel import graphs

    monkeypatch.setitem(graphs._BACKENDS, "cpu", TapeBackend)
    s = Settings(torch.device("cpu"), imgsz=64, smoke=True, warmup=0, repeats=1, iters=1, workers=0)
    step = TrainStep(s, "yolov8n", 2, "fp32", graphs=True)
    weight = step.model.head.cls[0][0].conv.weight
    seen = []
    for _ in range(5):
        step()
        seen.append(weight.detach().clone())
    assert (step.graphs.stats.eager, step.graphs.stats.recorded, step.graphs.stats.replays) == (2, 1, 2)
    assert all(not torch.equal(a, b) for a, b in zip(seen[:-1], seen[1:], strict=True))   # each call stepped
