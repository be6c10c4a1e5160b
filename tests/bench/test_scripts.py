"""Every script in benchmarks/ runs from the checkout as ``python benchmarks/<script>.py``
(nothing installed beyond yolokit), at tiny sizes, and prints the header and its rows.
The numbers are meaningless at these sizes; what is checked is that they are there."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
NUMBER = r"[0-9]+(?:\.[0-9]+)?"


def run_script(name: str, *args: str, cwd: Path | None = None) -> str:
    """The script's standard output (it must exit with status 0)."""
    done = subprocess.run([sys.executable, str(BENCHMARKS / name), *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("command: ") and name in lines[0]
    assert lines[1].startswith("machine: ") and lines[2].startswith("versions: ")
    return done.stdout


def test_run_py_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    text = run_script("run.py", "--cases", "nms", "--quick", "--no-reference", "--repeats", "1", "--warmup", "0",
                      "--json", str(out), cwd=tmp_path)  # from any folder, not only the checkout's root
    assert "reference: none" in text and "decode + NMS" in text
    saved = json.loads(out.read_text())
    assert [r["label"] for r in saved["results"]] == ["decode + NMS", "decode + NMS multi-label"]
    assert all(r["case"] == "nms" and r["ratio"] is None and r["ours"][0] > 0 for r in saved["results"])


@pytest.mark.slow
def test_gpu_py_cpu_smoke_runs_every_section(tmp_path):
    out = tmp_path / "gpu.json"
    text = run_script("gpu.py", "--cpu-smoke", "--models", "yolov8n", "--json", str(out))
    saved = json.loads(out.read_text())
    assert {"throughput", "checkpointing", "batch", "utilisation", "mfu"} <= set(saved)
    rows = saved["throughput"]
    assert [(r["precision"], r["channels_last"]) for r in rows] == [
        (p, cl) for p in ("fp32", "bf16", "fp16") for cl in (False, True)]  # no compile rows on the CPU
    assert all(r["images_per_s"] > 0 for r in rows) and rows[0]["speedup_vs_fp32"] == 1.0
    ckpt = saved["checkpointing"][0]
    assert ckpt["peak_gib"] > 0.05 and ckpt["peak_gib_checkpointed"] > 0.05  # the whole process's peak on the CPU
    batch = saved["batch"][0]
    assert 1 <= batch["find_batch_size"] <= batch["true_largest"] <= 4  # --cpu-smoke caps the batch at 4
    assert saved["utilisation"]["images_per_s"] > 0 and 0 <= saved["utilisation"]["data_wait_share"] < 1
    mfu = saved["mfu"][0]
    assert mfu["train_gflops_per_image"] == pytest.approx(0.26, rel=0.1)  # yolov8n at 64 px, forward + backward
    assert 0 < mfu["mfu"]
    assert ("reference: skipped" in text) == ("reference" not in saved)


SCRIPTS = {
    "losses.py": (["--batch", "2", "--imgsz", "64", "--repeats", "1", "--warmup", "0"],
                  [rf"TaskAlignedAssigner forward \(P=84\) +{NUMBER} ms", rf"YOLOv8Loss .* {NUMBER} ms",
                   rf"YOLOv3Loss .*Q=252\) +{NUMBER} ms"]),
    "step_overhead.py": (["--imgsz", "64", "--repeats", "1", "--warmup", "0"],
                         [rf"^{row} +before +{NUMBER} ms +after +{NUMBER} ms"
                          for row in ("step", "ema", "sgd", "adamw", "deterministic")]),
    "assigner_memory.py": (["--batch", "2", "--imgsz", "64", "--cases", "normal", "--rows", "assigner",
                            "--repeats", "1"],
                           [rf"normal \(10 boxes/image\) assigner +peak +{NUMBER} MiB +{NUMBER} ms"]),
    "data_pipeline.py": (["--imgsz", "64", "--images", "8", "--batch", "4", "--batches", "2", "--warmup", "1",
                          "--repeats", "1", "--workers", "0", "--uint8"],
                         [rf"^yolokit +{NUMBER} +{NUMBER}", rf"^yolokit uint8_images +{NUMBER} +{NUMBER}"]),
    "predict_memory.py": (["--counts", "3", "--size", "64", "--imgsz", "64", "--batch", "2", "--modes", "streamed"],
                          [rf"^\| 3 \| streamed \| {NUMBER} \| {NUMBER} \|$"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_script_runs_from_the_checkout(name):
    args, patterns = SCRIPTS[name]
    text = run_script(name, *args)
    for pattern in patterns:
        assert re.search(pattern, text, re.MULTILINE), (pattern, text)
