"""Every script in benchmarks/ runs from the checkout as ``python benchmarks/<script>.py``
(nothing installed beyond yolokit), at tiny sizes, and prints the header and its rows.
The numbers are meaningless at these sizes; what is checked is that they are there."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
NUMBER = r"[0-9]+(?:\.[0-9]+)?"


def run_script(name: str, *args: str, cwd: Path | None = None, timeout: float = 300) -> str:
    """The script's standard output (it must exit with status 0)."""
    done = subprocess.run([sys.executable, str(BENCHMARKS / name), *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)
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


GPU_SECTIONS = ["tests", "launch", "precision", "fused", "augment", "channels_last", "batch", "checkpointing", "mfu",
                "loader", "deploy", "seg", "reference", "epoch", "parity"]   # in order of priority (42; 52, 60, 61)


def gpu_rows(path: Path) -> dict[str, dict[str, dict]]:
    """Per section of gpu.py's JSON, its rows by what they measure."""
    saved = json.loads(path.read_text())
    return {name: {r["what"]: r for r in section["rows"]} for name, section in saved["sections"].items()}


@pytest.mark.slow
@pytest.mark.extended   # 6.5 min with a cold inductor cache on 2 cores (deploy's .pt2 builds: 265 s), 29 s warm;
# before a GPU pass run `pytest -m extended tests/bench` (benchmarks/NOTES-gpu.md)
def test_gpu_py_all_cpu_smoke_gives_every_section_its_numbers(tmp_path):
    out = tmp_path / "gpu-results.json"
    text = run_script("gpu.py", "--all", "--cpu-smoke", "--out", str(tmp_path), timeout=1200)
    assert (tmp_path / "gpu-results.txt").read_text().count("\n") > 20   # the table, beside the JSON
    rows = gpu_rows(out)
    assert list(rows) == GPU_SECTIONS
    for name in GPU_SECTIONS:
        assert re.search(rf"\({name}: {NUMBER} s\)", text)  # each section's elapsed time
    table = text[text.index("== GPU pass"):]
    for section in rows.values():
        for what, r in section.items():
            assert what != "error", r["note"]
            assert re.search(rf"^{r['section']} +{re.escape(what)} ", table, re.MULTILINE)
            if r["target"] is not None and r["value"] is not None:
                assert r["ok"] == {">=": r["value"] >= r["target"][1], "<=": r["value"] <= r["target"][1],
                                   "==": r["value"] == r["target"][1]}[r["target"][0]]

    tests = rows["tests"]  # the gpu-marked tests were collected and skipped (no CUDA), none failed
    assert tests["pytest -m gpu: failed or errors"]["value"] == 0
    assert tests["pytest -m gpu: passed"]["data"]["skipped"] >= 5
    assert "deselected" in tests["pytest -m gpu: passed"]["note"]

    parity = rows["parity"]   # parity.py's runs at tiny sizes: a seed, yolokit's side (both where ultralytics imports)
    assert parity["runs finished"]["value"] == len(parity["runs finished"]["data"]["sides"])
    assert 0 <= parity["yolokit mAP50-95 (yolokit val), mean over seeds"]["value"] <= 1
    assert {"runs.json", "table.md", "curves.png", "parity.log"} <= {f.name for f in (tmp_path / "parity").iterdir()}

    seg = rows["seg"]   # the segmentation step: both models stepped, the ratio of their rates
    assert seg["yolov8s-seg bf16 img/s"]["value"] > 0 and seg["yolov8s-seg bf16 peak memory"]["value"] is None
    assert seg["yolov8s-seg / yolov8s img/s"]["value"] > 0

    precision = rows["precision"]
    assert [r["value"] > 0 for r in precision.values()] == [True] * 6
    for p in ("bf16", "fp16"):
        for base, target in (("fp32 (TF32 conv)", 1.8), ("fp32, TF32 off", 3.0)):    # issue 42's targets
            r = precision[f"yolov8s {p} / {base} img/s"]
            rate = precision[f"yolov8s {base} img/s"]["value"]
            assert r["value"] == pytest.approx(r["data"]["images_per_s"] / rate) and r["target"] == [">=", target]

    layout = rows["channels_last"]
    pairs = [r for what, r in layout.items() if "on / off" in what]
    assert len(pairs) == 3 and all(r["value"] == pytest.approx(r["data"]["images_per_s_on"] /
                                                               r["data"]["images_per_s_off"]) for r in pairs)
    assert layout["faster with channels_last on (of 3)"]["value"] == sum(r["value"] > 1 for r in pairs)

    profiled = rows["augment"]["device pass: its top kernels"]                     # issue 42: the pass's profile
    assert profiled["note"].endswith("table in augment-profile.txt")
    assert "3 passes, sorted by cpu_time_total" in (tmp_path / "augment-profile.txt").read_text()

    ckpt = rows["checkpointing"]
    for name in ("yolov8l", "yolov3"):
        cut = ckpt[f"{name} batch 2 peak memory cut"]
        assert cut["data"]["peak_gib"] > 0.05 and cut["data"]["peak_gib_checkpointed"] > 0.05  # the process's peak
        assert cut["value"] == pytest.approx(100 * (1 - cut["data"]["peak_gib_checkpointed"] / cut["data"]["peak_gib"]))
        assert ckpt[f"{name} batch 2 step time on / off"]["value"] > 0

    batch = rows["batch"]  # an injected limit of 12 images, a memory model that fills it exactly
    for fraction, picked in ((0.95, 11), (0.9, 10)):  # AUTO_FRACTION and 0.9: floor((fraction * 1e9 - 1e8) / 7.5e7)
        found = batch[f"yolov8s finder at fraction {fraction:g} / true largest batch"]
        assert found["target"] == ([">=", 0.9] if fraction == 0.95 else None)
        assert (found["data"]["picked"], found["data"]["true_largest"]) == (picked, 12)
        assert found["value"] == pytest.approx(picked / 12)
        assert found["data"]["trials"] == [1, 2, 4, 8, picked]  # four probes and the check
        assert batch[f"yolov8s finder at fraction {fraction:g}: trials (sizes tried)"]["value"] == 5
    oom = batch["OOM mid-run: recoveries at step 3"]
    assert oom["value"] == 1 and oom["data"]["splits"] == 2 and oom["data"]["recoveries_total"] == 1
    assert oom["data"]["images_step3"] == oom["data"]["images_step4"] == oom["data"]["effective_batch"] == 4
    assert "effective batch unchanged" in oom["data"]["warnings"]
    assert batch["OOM mid-run: images in step 3 (effective batch 4)"]["ok"] is True

    loader = rows["loader"]
    for name in ("yolov8s", "yolov8n"):
        assert loader[f"{name} img/s with the real loader"]["value"] > 0
        busy = loader[f"{name} GPU utilisation with the real loader (NVML)"]
        assert busy["value"] is None and busy["note"] == "n/a on the CPU" and busy["data"]["steps"] == 2
    keep_up = loader["yolov8n: cores the loader needs to keep up"]
    assert keep_up["value"] == pytest.approx(keep_up["data"]["gpu_images_per_s"] / keep_up["data"]["per_core"])
    assert loader["loader img/s per core (per CPU-second)"]["value"] > 0

    epoch = rows["epoch"]   # the trainer itself on the smoke-sized COCO-like set: 32 images, batch 2, on each path
    for path in ("augment_on=workers", "augment_on=device"):       # the smoke run compiles nothing
        rate = epoch[f"yolov8s COCO-sized epoch, batch 2, {path}: img/s (the trainer)"]
        assert rate["value"] == pytest.approx(rate["data"]["images"] / rate["data"]["seconds"]) and rate["value"] > 0
        assert rate["data"]["images"] == 2 * 6 and rate["data"]["train_images"] == 32   # 6 batches after the first 2
        assert (rate["data"]["steps"], rate["data"]["batches"]) == (9, 16)   # the window's end stopped the trainer
        assert rate["data"]["augment_on"] == path.split("=")[1] and rate["target"] == [">=", 900.0]
        assert 0 <= epoch[f"waiting for data (data%), {path}"]["value"] <= 100
        assert epoch[f"GPU busy (NVML), {path}"]["note"] == "n/a on the CPU"
    assert epoch["first scan of 32 labels"]["value"] > 0

    fused = rows["fused"]   # the smoke run times the eager pass twice (no compile); the rows and the table are there
    assert fused["compiled pass == eager pass, bit for bit"]["value"] == 1.0
    assert fused["device pass img/s, compiled (batch 2)"]["data"]["eager"] > 0
    assert fused["HSV step, batch 2, compiled"]["value"] > 0
    assert fused["compiled pass: its top kernels"]["note"].endswith("table in fused-profile.txt")
    assert "compiled device pass, batch 2" in (tmp_path / "fused-profile.txt").read_text()

    launch = rows["launch"]   # the smoke run compiles nothing: the eager row and the best of them
    assert launch["yolov8n bf16 b2 img/s, eager"]["value"] > 0
    for mode in ("compile=reduce-overhead", "eager + cuda_graphs", "compile=default + cuda_graphs"):
        assert launch[f"yolov8n bf16 b2 img/s, {mode}"]["note"] == "skipped: no compile or CUDA graph in the smoke run"
    assert launch["yolov8n img/s, best of the above"]["value"] == launch["yolov8n bf16 b2 img/s, eager"]["value"]
    assert launch["yolov8n img/s, best of the above"]["target"] == [">=", 2000.0]

    mfu = rows["mfu"]
    eager = mfu["yolov8l MFU, bf16 channels_last"]
    assert eager["data"]["train_gflops_per_image"] == pytest.approx(3 * 165.2 / 100, rel=0.05)  # 3 x forward at 64 px
    assert eager["value"] == pytest.approx(100 * eager["data"]["train_gflops_per_image"] * 1e9 *
                                           eager["data"]["images_per_s"] / (eager["data"]["peak_tflops"] * 1e12))
    assert mfu["yolov8l MFU, bf16 channels_last, compiled"]["note"] == "skipped: no compile in the smoke run"
    assert mfu["yolov8l MFU, best of the above"]["value"] == eager["value"]

    from harness.reference import version
    if version() is None:
        assert rows["reference"]["step time yolokit / Ultralytics"]["note"] == "skipped: ultralytics not importable"
    else:
        assert all(r["value"] > 0 for r in rows["reference"].values())


@pytest.mark.slow
@pytest.mark.extended   # 9 s of GPU-pass tooling, run before a GPU pass with the all-section smoke above
def test_gpu_py_reference_in_another_interpreter_and_no_cuda(tmp_path):
    out = tmp_path / "gpu-results.json"
    text = run_script("gpu.py", "--sections", "reference", "--cpu-smoke", "--reference-python", sys.executable,
                      "--out", str(tmp_path))
    assert "  | " in text  # the other interpreter's lines
    assert list(gpu_rows(out)) == ["reference"]
    assert all(r["what"] != "error" for r in gpu_rows(out)["reference"].values())
    if not torch.cuda.is_available():
        done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu.py"), "--all"], capture_output=True, text=True)
        assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr


def _gpu_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_pass", BENCHMARKS / "gpu.py")   # gpu/ is the package
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_pass_plan_fits_a_session_of_device_time():
    """Issue 42: a session's 15 minutes hold a machine's start, the correct-on-GPU command (about 4
    minutes) and the pass (one command of at most 9), whose sections run in the issue's order of
    priority while their caps fit; every section is in the pass or among those left; --plan prints them."""
    gpu = _gpu_script()
    assert list(gpu.SECTIONS) == GPU_SECTIONS and set(gpu.CAPS) == set(GPU_SECTIONS)
    measured = [n for n in GPU_SECTIONS if n != "tests"]
    first = gpu.fitting(measured, gpu.FIRST_BUDGET_S)
    assert first == ["launch", "precision", "fused", "augment", "checkpointing"]   # the unknowns that decide defaults
    assert gpu.PASS_COMMAND_S <= 540 and gpu.CORRECT_TIMEOUT_S <= 330
    assert gpu.START_S + gpu.CORRECT_TIMEOUT_S + gpu.PASS_COMMAND_S <= gpu.LEASE_S
    assert gpu.SETUP_S + gpu.FIRST_BUDGET_S <= gpu.PASS_COMMAND_S
    assert all(cap <= gpu.FIRST_BUDGET_S for name, cap in gpu.CAPS.items() if name != "parity")
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu.py"), "--plan"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    commands = [line for line in done.stdout.splitlines() if "benchmarks/gpu.py" in line and not line.startswith("#")
                and line != gpu.correct_command()]   # issue 41's command, printed first (test_correct_command.py)
    assert all(len(c) <= 2000 for c in commands)                       # the device tool's limit on a command
    assert f"--sections {' '.join(first)} --budget {gpu.FIRST_BUDGET_S} " in commands[0]
    rest = [n for n in measured if n not in first]
    later = [re.search(r"--sections ([\w ]+) --budget (\d+) ", c).groups() for c in commands[1:]]
    ran = [n for names, _ in later for n in names.split()]
    assert sorted(ran) == sorted(rest) and len(ran) == len(rest)       # every section left, once
    assert later[0][0].split() == gpu.fitting(rest, gpu.FIRST_BUDGET_S)   # in order while the caps fit
    for names, budget in later:          # each command fits one session's pass (parity: a command of its own)
        assert int(budget) == sum(gpu.CAPS[n] for n in names.split())
        assert int(budget) <= (gpu.COMMAND_S - gpu.SETUP_S if names == "parity" else gpu.FIRST_BUDGET_S)
    assert all("--out $OUT" in c and "--reference-python /tmp/refpy" in c and ".whl/*.whl" in c for c in commands)
    assert later[-1][0].split() == ["parity"]     # issue 61's runs: a command of their own, the last
    # its estimate fits its cap with a margin, and its command (timeout_s 600) holds the setup, the cap, the grace
    assert gpu.parity_runs.estimate_s() <= 0.95 * gpu.CAPS["parity"]
    assert gpu.SETUP_S + gpu.CAPS["parity"] + gpu.parity_runs.GRACE_S <= gpu.COMMAND_S


def test_gpu_pass_runs_what_fits_its_budget_and_names_the_rest(tmp_path, monkeypatch, capsys):
    """--budget: a section runs only if its cap fits what is left; a smaller later one still runs;
    the JSON and the console name the sections left, with the command that runs them."""
    from types import SimpleNamespace

    gpu = _gpu_script()
    ran, now = [], [0.0]

    def section(name, s, reference_python):   # each section spends 90% of its cap
        ran.append(name)
        now[0] += 0.9 * gpu.CAPS[name]
        return [gpu.Row(name, "a row", 1.0)], 0.9 * gpu.CAPS[name]

    monkeypatch.setattr(gpu, "run_section", section)
    monkeypatch.setattr(gpu, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(gpu, "CAPS", {**gpu.CAPS, "precision": 50, "channels_last": 60, "checkpointing": 40})
    assert gpu.main(["--sections", "checkpointing", "precision", "channels_last", "--budget", "95", "--cpu-smoke",
                     "--out", str(tmp_path)]) == 0
    assert ran == ["precision", "checkpointing"]   # in priority order; 45 spent: 60 > 50 left, 40 <= 50
    saved = json.loads((tmp_path / "gpu-results.json").read_text())
    assert saved["left"] == ["channels_last"] and list(saved["sections"]) == ran
    assert "--sections channels_last --budget 60 " in capsys.readouterr().out


def test_gpu_pass_writes_its_results_after_every_section(tmp_path, monkeypatch):
    """A command stopped at its limit still returns what its finished sections measured."""
    gpu = _gpu_script()
    done = []

    def section(name, s, reference_python):
        if done:
            raise KeyboardInterrupt("the device stopped the command")
        done.append(name)
        return [gpu.Row(name, "a row", 1.5, "x", (">=", 1.0))], 0.1

    monkeypatch.setattr(gpu, "run_section", section)
    with pytest.raises(KeyboardInterrupt):
        gpu.main(["--sections", "precision", "mfu", "--cpu-smoke", "--out", str(tmp_path)])
    rows = gpu_rows(tmp_path / "gpu-results.json")
    assert rows == {"precision": {"a row": rows["precision"]["a row"]}} and rows["precision"]["a row"]["ok"]
    assert "precision" in (tmp_path / "gpu-results.txt").read_text()


def test_gpu_parity_section_stops_at_its_cap_and_resumes_its_runs(tmp_path, monkeypatch):
    """Issue 61's section: a run starts only while its estimate (the longest run so far) fits the cap; a run
    stopped at the cap is removed and the rest left; the next call takes the finished runs from their records
    and trains only the others; the rows are each side's mean (min-max) over its seeds."""
    import dataclasses

    gpu = _gpu_script()
    runs = gpu.parity_runs
    now, calls, kill = [0.0], [], set()

    class FakeClock:
        def __init__(self, cap_s):
            self.cap_s = cap_s

        def elapsed(self):
            return now[0]

    def call(cmd, env, limit, log, cwd):   # parity.py's run, 100 s of it: the run's folder, its runs.json
        side, seed = cmd[cmd.index("--sides") + 1], int(cmd[cmd.index("--seeds") + 1])
        calls.append(f"{side}-{seed}")
        now[0] += 100
        run = Path(cmd[cmd.index("--out") + 1]) / f"{side}-{seed}"
        (run / "weights").mkdir(parents=True, exist_ok=True)
        (run / "weights" / "last.pt").write_bytes(b"")
        if f"{side}-{seed}" in kill:          # cut short: no epoch written
            (run / "results.csv").write_text("epoch,mAP50\n")
            return -9, 100.0, ["killed"]
        (run / "results.csv").write_text("epoch,mAP50\n1,0.5\n")
        score = 0.1 * (seed + 1) + (0.05 if side == "reference" else 0.0)
        record = {"side": side, "seed": seed, "seconds": 99.0, "scores": {"mAP50": 2 * score, "mAP50-95": score},
                  "reference_val": {"mAP50": 2 * score, "mAP50-95": score + 0.01},
                  "curve": {"box50": [2 * score], "box": [score], "mask": [], "first_50": None}}
        (run.parent / "runs.json").write_text(json.dumps([record]))
        return 0, 100.0, []

    plan = runs.plan
    monkeypatch.setattr(runs, "plan", lambda s, reference: dataclasses.replace(plan(s, reference), seeds=(0, 1, 2)))
    monkeypatch.setattr(runs, "interpreter", lambda python: (sys.executable, {"ultralytics": "8", "polars": True}, ""))
    monkeypatch.setattr(runs, "call", call)
    s = dataclasses.replace(gpu.settings(True), out=tmp_path)

    rows = {r.what: r for r in runs.parity(s, FakeClock(250))}   # two runs of 100 s fit, the third would not
    assert calls == ["yolokit-0", "reference-0"] and rows["runs finished"].value == 2
    assert "left at the cap: yolokit-1 reference-1 yolokit-2 reference-2" in rows["runs finished"].note
    assert len(json.loads((tmp_path / "parity" / "runs.json").read_text())) == 2

    calls.clear()
    kill.add("yolokit-1")
    rows = {r.what: r for r in runs.parity(s, FakeClock(1e6))}   # the earlier two from their records
    assert calls == ["yolokit-1"] and rows["runs finished"].value == 2   # stopped: the rest left, its folder gone
    assert not (tmp_path / "parity" / "runs" / "yolokit-1").exists()

    calls.clear()
    kill.clear()
    rows = {r.what: r for r in runs.parity(s, FakeClock(1e6))}
    assert calls == ["yolokit-1", "reference-1", "yolokit-2", "reference-2"] and rows["runs finished"].value == 6
    ours = rows["yolokit mAP50-95 (yolokit val), mean over seeds"]
    assert ours.value == pytest.approx(0.2) and (ours.data["min"], ours.data["max"]) == pytest.approx((0.1, 0.3))
    assert rows["reference mAP50-95 (reference val), mean over seeds"].value == pytest.approx(0.26)
    assert rows["mAP50-95 yolokit - reference (yolokit val), means"].value == pytest.approx(-0.05)
    table = (tmp_path / "parity" / "table.md").read_text().splitlines()
    assert len(table) == 2 + 6 + 2 and table[-2].startswith("| yolokit | mean (min-max) | ")


def test_gpu_wheels_fetches_cp312_manylinux_wheels_of_the_reference_without_dependencies(tmp_path):
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_wheels.py"), "--dry-run", "--dest", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    cmd = done.stdout.split()
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and cmd[cmd.index("-d") + 1] == str(tmp_path)
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd and "manylinux2014_x86_64" in cmd
    assert {c.split("==")[0] for c in cmd if "==" in c} == {"ultralytics", "ultralytics-thop", "ultralytics-platform"}


SCRIPTS = {
    "losses.py": (["--batch", "2", "--imgsz", "64", "--repeats", "1", "--warmup", "0"],
                  [rf"TaskAlignedAssigner assign_rows \(P=84\) +{NUMBER} ms", rf"YOLOv8Loss .* {NUMBER} ms",
                   rf"YOLOv3Loss .*Q=252\) +{NUMBER} ms"]),
    "step_overhead.py": (["--imgsz", "64", "--repeats", "1", "--warmup", "0"],
                         [rf"^{row} +before +{NUMBER} ms +after +{NUMBER} ms"
                          for row in ("step", "ema", "sgd", "adamw", "deterministic")]),
    "assigner_memory.py": (["--batch", "2", "--imgsz", "64", "--cases", "normal", "--rows", "assigner",
                            "--repeats", "1"],
                           [rf"normal \(10 boxes/image\) assigner +peak +{NUMBER} MiB +{NUMBER} ms"]),
    "data_pipeline.py": (["--imgsz", "64", "--images", "8", "--batch", "4", "--batches", "2", "--warmup", "1",
                          "--repeats", "1", "--workers", "0", "--uint8", "--augment-on-device"],
                         [rf"^yolokit +{NUMBER} +{NUMBER}", rf"^yolokit uint8_images +{NUMBER} +{NUMBER}",
                          rf"^yolokit augment_on device +{NUMBER} +{NUMBER}"]),
    "demo_split.py": (["--epochs", "1", "--imgsz", "64"],
                      [rf"^\| epoch \| {NUMBER} \|$", rf"^\| steps \| {NUMBER} \|$", rf"^\| the rest \| {NUMBER} \|$",
                       rf"^\| callbacks: CSVLogger.on_epoch_end \| {NUMBER} \|$"]),
    "seg_loader.py": (["--runs", "1", "--imgsz", "64", "--batches", "1", "--workers", "0", "--interleaved", "1",
                       "--persistent"],
                      [rf"^\| with masks \| {NUMBER} \({NUMBER}\) \| {NUMBER} \({NUMBER}\) \|$",
                       # the CPU column n/a when the boxes-only run took no tick of the CPU clock (10 ms)
                       rf"^\| ratio, median of the 1 pairs of runs \| \*\*{NUMBER}x\*\* \| (\*\*{NUMBER}x\*\*|n/a) \|$",
                       rf"^\| in one process, batches alternating, 1 pass, each a first epoch \| "
                       rf"with masks {NUMBER} ms/image .* "
                       rf"median \*\*{NUMBER}x\*\* \|$"]),
    "parity_table.py": (["--row", "as they are", "benchmarks/parity-runs/shapes-yolov8n.json",
                          "--row", "again", "benchmarks/parity-runs/shapes-yolov8n.json",
                          "--base-row", "another day", "benchmarks/parity-runs/shapes-yolov8n-yolokit-2026-12-04.json",
                          "--row", "that day again", "benchmarks/parity-runs/shapes-yolov8n-yolokit-2026-12-04.json"],
                         [rf"^\| as they are \| reference \| 0, 1, 2, 3, 4 \| {NUMBER} \({NUMBER}-{NUMBER}\) "
                          r"\| baseline \|",
                          r"^\| again \| yolokit \| 0, 1, 2, 3, 4 \| .* \| \+0\.000 \|",
                          r"^\| another day \| yolokit \| 0, 1, 2, 3, 4 \| .* \| baseline \|",   # its own baseline
                          r"^\| that day again \| yolokit \| 0, 1, 2, 3, 4 \| .* \| \+0\.000 \|"]),
    "predict_memory.py": (["--counts", "3", "--size", "64", "--imgsz", "64", "--batch", "2", "--modes", "streamed"],
                          [rf"^\| 3 \| streamed \| {NUMBER} \| {NUMBER} \|$"]),
}


# By default one script runs (the loader's, with every path); the others, benchmarks run by hand,
# run with -m extended (gpu.py, which a GPU session runs unattended, runs by default above).
@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n == "data_pipeline.py" else [pytest.mark.extended])
                                  for n in sorted(SCRIPTS)])
def test_script_runs_from_the_checkout(name):
    args, patterns = SCRIPTS[name]
    text = run_script(name, *args)
    for pattern in patterns:
        assert re.search(pattern, text, re.MULTILINE), (pattern, text)


def test_suite_sh_parses_and_names_its_two_modes():
    """benchmarks/suite.sh (the suite timed and its coverage, in fresh clones) is bash that parses; a wrong
    mode gets its usage line and exit 2 before anything is cloned. Its two modes run by hand (README)."""
    script = BENCHMARKS / "suite.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    done = subprocess.run(["bash", str(script), "timing"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "usage: benchmarks/suite.sh time [RUNS] [REF] | coverage [REF]" in done.stderr


@pytest.mark.extended   # ~20 s: four processes that import torch, two tiny runs
def test_parity_py_trains_each_seed_in_its_own_process_and_tables_them(tmp_path):
    """benchmarks/parity.py's plumbing on yolokit's side alone (the reference side needs the bench
    environment): one process per seed, every final weight scored, a row per seed and a mean (min-max),
    the curves kept; a second call scores the runs it finds instead of training them again."""
    from _models import TINY

    from yolokit.data import make_shapes

    data = make_shapes(tmp_path / "set", n_train=8, n_val=4, imgsz=64, segments=True)
    # a stand-in for ultralytics: its import sets OMP_NUM_THREADS=1 when unset, as the real one's does, then fails
    # (so no reference validator): the runs after the first scoring must not inherit it
    (tmp_path / "fake" / "ultralytics").mkdir(parents=True)
    (tmp_path / "fake" / "ultralytics" / "__init__.py").write_text(
        "import os\nos.environ.setdefault('OMP_NUM_THREADS', '1')\nraise ImportError('a stand-in')\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "fake"), *filter(None, [env.get("PYTHONPATH")])])
    fresh = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                           capture_output=True, text=True, timeout=120)
    args = [sys.executable, str(BENCHMARKS / "parity.py"), "--model", TINY, "--data", str(data), "--seeds", "0", "1",
            "--sides", "yolokit", "--epochs", "1", "--imgsz", "64", "--batch", "4", "--nbs", "4", "--workers", "0",
            "--out", str(tmp_path / "out"), "--set", "yolokit.warmup_min_steps=0", "--set", "reference.warmup_epochs=2",
            "--set", "yolokit.hue_mode=shift"]                               # a flat augmentation key too
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads((tmp_path / "out" / "runs.json").read_text())
    assert [(r["side"], r["seed"]) for r in runs] == [("yolokit", 0), ("yolokit", 1)]
    assert [r["threads"] for r in runs] == [int(fresh.stdout)] * 2       # each run on the threads of a fresh process
    assert all(len(r["curve"]["box"]) == 1 and 0 <= r["scores"]["mAP50-95"] <= 1 for r in runs)
    table = (tmp_path / "out" / "table.md").read_text().splitlines()
    assert table[0] == "| side | seed | mAP50 | mAP50-95 | epoch at mAP50 0.5 |" and len(table) == 2 + 2 + 1
    assert all(r["curve"]["first_50"] in (None, 1) and len(r["curve"]["box50"]) == 1 for r in runs)
    assert (tmp_path / "out" / "curves.png").stat().st_size > 1000
    config = (tmp_path / "out" / "yolokit-0" / "config.yaml").read_text()
    assert "warmup_min_steps: 0\n" in config and "warmup_epochs: 1.0\n" in config     # one side's setting only
    assert "hue_mode: shift\n" in config
    assert re.fullmatch(rf"\| yolokit \| mean \(min-max\) \| {NUMBER} \({NUMBER}-{NUMBER}\) \| .*", table[-1])
    stamp = (tmp_path / "out" / "yolokit-0" / "weights" / "last.pt").stat().st_mtime_ns
    again = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    last = tmp_path / "out" / "yolokit-0" / "weights" / "last.pt"
    assert again.returncode == 0 and last.stat().st_mtime_ns == stamp


def test_parity_py_gives_an_assigner_option_to_every_loss_of_its_run(tmp_path, monkeypatch):
    """``--set yolokit.assigner.contested=any``: an ablation's switch the trainer has no setting for."""
    import importlib.util

    import yolokit.losses.yolo26 as yolo26
    import yolokit.losses.yolov8 as yolov8
    from yolokit.losses import YOLO26Loss, YOLOv8Loss

    for module in (yolov8, yolo26):                                  # put back after the test
        monkeypatch.setattr(module, "TaskAlignedAssigner", module.TaskAlignedAssigner)
    spec = importlib.util.spec_from_file_location("parity_under_test", BENCHMARKS / "parity.py")
    parity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(parity)
    assert YOLOv8Loss(2, (8, 16, 32)).assigner.contested == "kept"
    preset = parity.overrides(["yolokit.assigner.contested=any", "yolokit.warmup_min_steps=0"], "yolokit")
    assert preset == {"assigner.contested": "any", "warmup_min_steps": 0}
    with pytest.raises(ValueError, match="contested"):
        parity.patch_assigner({"contested": "some"}, tmp_path / "bad")
    parity.patch_assigner({"contested": "any"}, tmp_path / "run")
    assert YOLOv8Loss(2, (8, 16, 32), min_gt_side=16).assigner.contested == "any"
    assert YOLOv8Loss(2, (8, 16, 32), min_gt_side=16).assigner.min_gt_side == 16.0   # the loss's own still count
    assert YOLO26Loss(2, (8, 16, 32)).one2one.assigner.topk2 == 1
    assert (tmp_path / "run" / "assigner.yaml").read_text() == "contested: any\n"


def _parity_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("parity_cmd", BENCHMARKS / "parity.py")
    parity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(parity)
    return parity


def test_parity_py_refuses_a_reference_run_it_cannot_finish_before_training(tmp_path, monkeypatch):
    """The reference imports polars only when it first saves a checkpoint: a command whose interpreter lacks it
    (or ultralytics) stops before any run, naming what is missing, and leaves no folder; yolokit's side alone
    is not asked for either."""
    import importlib.util

    parity = _parity_script()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "polars" else real(name, *a))

    class Started(Exception):
        pass

    def train_process(cmd):
        raise Started(cmd)

    monkeypatch.setattr(parity, "train_process", train_process)
    out = tmp_path / "runs"
    monkeypatch.setattr(sys, "argv", ["parity.py", "--seeds", "0", "--out", str(out)])
    with pytest.raises(SystemExit, match=r"cannot import (ultralytics, )?polars, which the reference"):
        parity.main()
    assert not out.exists()
    monkeypatch.setattr(sys, "argv", ["parity.py", "--seeds", "0", "--sides", "yolokit", "--out", str(out)])
    with pytest.raises(Started) as started:                       # yolokit's side alone: its first run starts
        parity.main()
    assert started.value.args[0][-3:] == ["--one", "yolokit", "0"]


def test_parity_py_resumes_only_yolokit_runs_of_the_same_settings(tmp_path, monkeypatch):
    """A yolokit run cut short goes on from its checkpoint only when the command's settings are those it started
    with (its ``parity.json``); another epoch count, another setting of its side or no record: from its start.
    The reference's runs always start again; the other side's settings and the seeds do not count."""
    parity = _parity_script()

    def args(*flags):
        return parity_args(parity, list(flags), monkeypatch)

    run = tmp_path / "yolokit-0"
    (run / "weights").mkdir(parents=True)
    (run / "weights" / "last.pt").write_bytes(b"")
    first = args("--epochs", "3", "--set", "yolokit.hue_mode=shift")
    assert not parity.resumable("yolokit", run, first)                                 # no record
    (run / "parity.json").write_text(json.dumps(parity.run_settings("yolokit", first)))
    assert parity.resumable("yolokit", run, first)
    assert parity.resumable("yolokit", run, args("--epochs", "3", "--set", "yolokit.hue_mode=shift", "--seeds", "0",
                                                 "--set", "reference.warmup_epochs=4"))
    assert not parity.resumable("yolokit", run, args("--epochs", "4", "--set", "yolokit.hue_mode=shift"))
    assert not parity.resumable("yolokit", run, args("--epochs", "3"))
    assert not parity.resumable("reference", run, first)
    (run / "weights" / "last.pt").unlink()
    assert not parity.resumable("yolokit", run, first)                                 # nothing to resume from


def parity_args(parity, flags: list[str], monkeypatch):
    """parity.py's parsed arguments for ``flags`` (its preset filled in), as its ``main`` makes them."""
    seen = []
    monkeypatch.setattr(parity, "train_one", lambda side, seed, args: seen.append(args))
    monkeypatch.setattr(sys, "argv", ["parity.py", *flags, "--one", "yolokit", "0"])
    assert parity.main() == 0
    return seen[0]
