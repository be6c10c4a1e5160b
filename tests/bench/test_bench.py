"""Tests of yolokit.bench: the alternating timer, memory readings, inputs, and a quick run
of cheap cases without the reference (ultralytics is never imported here)."""

import json
import sys

import numpy as np
import pytest
import torch

from yolokit.bench import CASES, Result, inputs, run
from yolokit.bench.timing import Timed, alternate, peak_memory
from yolokit.cli import main


def test_alternate_runs_in_turns_and_counts_units():
    order = []
    fns = [lambda: order.append("a"), lambda: order.append("b") or Timed(2.0, 4)]
    runs = alternate(fns, warmup=1, repeats=3, inner=2)
    assert order == ["a", "b"] + ["a", "a", "b", "b"] * 3
    assert len(runs[0]) == 3 and all(t >= 0 for t in runs[0])
    assert runs[1] == [0.5, 0.5, 0.5]  # two calls of (2 s, 4 units) per run: 4 s over 8 units


def test_result_ratio_and_units():
    r = Result("data", "x", "img/s", ours=[0.01, 0.02, 0.03], theirs=[0.04, 0.04, 0.05])
    assert r.ratio == pytest.approx(0.5)
    assert r.value(r.ours) == pytest.approx(50.0)  # images per second from seconds per image
    assert Result("nms", "y", "ms", ours=[0.002]).value([0.002]) == pytest.approx(2.0)
    assert Result("nms", "y", "ms", ours=[0.002]).ratio is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="resident-set readings are Linux only")
def test_peak_memory_sees_a_large_temporary():
    got = peak_memory(lambda: torch.ones(64, 2**20).sum())  # 256 MiB, freed at once
    assert got is None or got > 200 * 2**20


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


def test_unknown_case_is_an_error():
    with pytest.raises(ValueError, match="unknown case"):
        run(["nope"], reference=False, echo=None)
    assert set(CASES) == {"train", "inference", "nms", "loss", "data", "eval"}


def test_cli_bench_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--cases", "nms", "--quick", "--no-reference", "--repeats", "1", "--warmup", "0",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "reference: none" in text and "decode + NMS" in text and "machine:" in text
    saved = json.loads(out.read_text())
    assert saved["results"][0]["case"] == "nms" and saved["results"][0]["ratio"] is None
