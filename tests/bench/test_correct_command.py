"""Issue 41's correct-on-GPU command (``benchmarks/gpu.py``'s ``correct_command``), checked on the CPU.

The device tool takes a command of at most 2,000 characters and brings back at most 8 files
from ``$OUT``, none more than 2 folders down, named in letters, digits, '.', '_' and '-'. The
command runs here with bash from the checkout's root, with stub programs first on PATH: a
``compute-sanitizer`` that runs the program after its options, and (in the quick tests) a
``python3`` that only says how it was called and exits as the test wants. The real run, with
the real Python (every gpu test skips, the augment section exits 2 without CUDA), is extended.
"""

import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
NAME = re.compile(r"[A-Za-z0-9._-]+")
FILES = ["0-summary.txt", "1-gpu-tests.log", "1-gpu-tests.xml", "2-memcheck.txt", "3-initcheck.txt",
         "4-augment-runs.txt"]

SANITIZER = """#!/bin/bash
echo "compute-sanitizer $*"
case "$*" in *"--tool initcheck"*) [ -n "$HANG_INITCHECK" ] && echo "initcheck: started" && exec sleep 30;; esac
while [ "${1#--}" != "$1" ]; do shift 2; done   # its options, each with a value
exec "$@"
"""

PYTHON = """#!/bin/bash
echo "python3 $* (caching: ${PYTORCH_NO_CUDA_MEMORY_CACHING:-on})"
case "$*" in
  *-m\\ pytest*) echo "1 failed"; exit 1;;
  *aug2) echo "terminate called after throwing an instance of 'c10::AcceleratorError'"; exit 134;;
  *aug3) exec sleep 30;;
esac
"""


@pytest.fixture(scope="module")
def gpu():
    spec = importlib.util.spec_from_file_location("gpu_pass_correct", BENCHMARKS / "gpu.py")   # gpu/ is the package
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stubs(folder: Path, python: str | None) -> dict[str, str]:
    """The environment of a run: stub ``compute-sanitizer`` (and ``python3``: the stub, or this
    interpreter when ``python`` is None) first on PATH, ``$OUT`` and the scratch folder in ``folder``."""
    bin_ = folder / "bin"
    bin_.mkdir()
    (bin_ / "compute-sanitizer").write_text(SANITIZER)
    if python is None:
        (bin_ / "python3").symlink_to(sys.executable)
    else:
        (bin_ / "python3").write_text(python)
    for f in bin_.iterdir():
        f.chmod(0o755)
    (folder / "out").mkdir()
    (folder / "tmp").mkdir()
    return {**os.environ, "PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}", "OUT": str(folder / "out"),
            "TMPDIR": str(folder / "tmp")}


def returned(out: Path) -> dict[str, str]:
    """What the device tool would bring back from ``$OUT``, asserting its limits: path -> text."""
    files = sorted(p for p in out.rglob("*") if p.is_file())
    assert len(files) <= 8, files
    for p in files:
        parts = p.relative_to(out).parts
        assert len(parts) <= 3 and all(NAME.fullmatch(part) for part in parts), p
    return {str(p.relative_to(out)): p.read_text(errors="replace") for p in files}


def step_exits(summary: str) -> dict[str, int]:
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\S+): exit (\d+) after \d+ s \(limit \d+ s\)$", summary, re.M)}


def test_the_command_fits_the_device_tool_and_runs_every_step(gpu):
    cmd = gpu.correct_command()
    assert len(cmd) <= 2000                                     # the device tool refuses a longer command
    assert subprocess.run(["bash", "-n", "-c", cmd]).returncode == 0   # bash parses it
    assert "export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1" in cmd
    assert re.search(r"python3 -m pytest -m gpu -n 0 -rA --tb=long -p no:cacheprovider .*mark\.gpu", cmd)
    for tool in ("memcheck", "initcheck"):   # each sanitizer on the script, without PyTorch's caching allocator
        assert re.search(rf"env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer [^;|]*--tool {tool} "
                         rf"python3 benchmarks/gpu/sanitize.py [^;|]*> \$OUT/\d-{tool}.txt 2>&1", cmd)
    assert cmd.index("--tool memcheck") < cmd.index("--tool initcheck") < cmd.index("--sections augment")
    assert f"for k in $(seq {gpu.AUGMENT_RUNS}); do" in cmd
    assert "python3 benchmarks/gpu.py --sections augment --no-tests" in cmd
    assert " && " not in cmd and "set -e" not in cmd           # a step that fails does not stop the others
    assert set(re.findall(r"\$OUT/([\w.-]+)", cmd)) == set(FILES)


def test_the_limits_fit_five_minutes_and_a_half(gpu):
    steps = gpu.correct_steps()
    assert [s[0] for s in steps] == ["1-gpu-tests", "2-memcheck", "3-initcheck"] + [
        f"4-augment-run{k}" for k in range(1, gpu.AUGMENT_RUNS + 1)]
    total = sum(limit + grace for _, limit, grace in steps)
    assert total <= 326 and gpu.CORRECT_TIMEOUT_S <= 330 and total < gpu.CORRECT_TIMEOUT_S
    # the augment shapes set is made in the background and waited for before the augment runs:
    # it ends before the sanitizers' limits do, so it adds nothing to the total
    sanitizers_end = sum(limit + grace for _, limit, grace in steps[:3])
    assert sanitizers_end >= gpu.SHAPES_LIMIT_S
    for name, limit, _ in steps:
        assert f"r {name if not name.startswith('4-') else '4-augment-run$k'} {limit} " in gpu.correct_command()


def test_the_background_shapes_set_is_the_one_the_augment_section_reads_on_cuda(gpu, monkeypatch):
    import torch
    from gpu import common

    asked = []
    monkeypatch.setattr(common, "dataset_yaml", lambda **kw: asked.append(kw))
    s = gpu.Settings(torch.device("cuda"), 640, False, warmup=5, repeats=3, iters=10, workers=1)  # as settings()
    common.shapes_yaml(s)
    assert asked == [{"images": gpu.SHAPES_IMAGES, "imgsz": gpu.SHAPES_IMGSZ}]
    assert f"dataset_yaml(images={gpu.SHAPES_IMAGES}, imgsz={gpu.SHAPES_IMGSZ})" in gpu.correct_command()


def test_the_plan_prints_it_first(gpu):
    lines = gpu.plan().splitlines()
    assert lines[0].startswith("# first, issue 41's correct-on-GPU command")
    assert f"timeout_s {gpu.CORRECT_TIMEOUT_S}" in lines[0] and "carry nothing" in lines[0]
    assert lines[1] == gpu.correct_command()
    passes = [i for i, line in enumerate(lines) if "--reference-python" in line and not line.startswith("#")]
    assert len(passes) >= 2 and passes[0] > 1   # the pass's commands, unchanged, after it


def test_every_step_runs_and_the_summary_names_each_exit_status(gpu, tmp_path):
    """Stub programs: the tests fail (1), augment run 2 aborts (134), run 3 hangs and is stopped
    at its limit (124); each later step still runs, and each file says what happened."""
    env = stubs(tmp_path, PYTHON)
    cmd = gpu.correct_command(limits={"augment": 1})
    done = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    got = returned(tmp_path / "out")
    assert sorted(got) == sorted(f for f in FILES if f != "1-gpu-tests.xml")   # the stub pytest writes no xml
    summary = got["0-summary.txt"]
    assert summary.startswith("correct-on-GPU command (issue 41), started ") and done.stdout.endswith(summary)
    assert step_exits(summary) == {"1-gpu-tests": 1, "2-memcheck": 0, "3-initcheck": 0, "4-augment-run1": 0,
                                   "4-augment-run2": 134, "4-augment-run3": 124}
    assert "augment shapes set: exit 0" in summary and summary.rstrip().endswith("all steps ended")
    assert "python3 -m pytest -m gpu" in got["1-gpu-tests.log"] and "tests/train/test_step_syncs.py" in \
        got["1-gpu-tests.log"]                                 # the files that mark tests gpu
    for tool in ("memcheck", "initcheck"):
        text = got[f"{2 if tool == 'memcheck' else 3}-{tool}.txt"]
        assert f"--tool {tool} python3 benchmarks/gpu/sanitize.py" in text
        step = "" if tool == "memcheck" else " --no-step"          # initcheck: the augmentation alone
        assert f"python3 benchmarks/gpu/sanitize.py --imgsz 128 --batch 2{step} (caching: 1)" in text
    runs = got["4-augment-runs.txt"]
    assert [int(k) for k in re.findall(r"^== augment run (\d) ==$", runs, re.M)] == [1, 2, 3]
    assert re.findall(r"^== augment run \d: exit (\d+) ==$", runs, re.M) == ["0", "134", "124"]
    assert runs.count("--sections augment --no-tests --out ") == 3 and "(caching: on)" in runs


def _kill_session(sid: int) -> None:
    """SIGKILL to every process of session ``sid`` (the test's command, and timeout's own process groups)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:   # after the name: state, ppid, pgrp, session
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(stat.parent.name), signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads sessions from /proc")
def test_a_command_killed_midway_leaves_what_it_wrote(gpu, tmp_path):
    """The device tool stops the command during initcheck: the summary has the steps that ended,
    and every file written so far is there."""
    env = {**stubs(tmp_path, PYTHON), "HANG_INITCHECK": "1"}
    proc = subprocess.Popen(["bash", "-c", gpu.correct_command()], cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    initcheck = tmp_path / "out" / "3-initcheck.txt"
    try:
        deadline = time.monotonic() + 30
        while not (initcheck.is_file() and "initcheck: started" in initcheck.read_text()):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
    finally:
        _kill_session(proc.pid)
        proc.wait(timeout=10)
    got = returned(tmp_path / "out")
    assert sorted(got) == ["0-summary.txt", "1-gpu-tests.log", "2-memcheck.txt", "3-initcheck.txt"]
    assert step_exits(got["0-summary.txt"]) == {"1-gpu-tests": 1, "2-memcheck": 0}
    assert "all steps ended" not in got["0-summary.txt"]
    assert "sanitize.py --imgsz 128 --batch 2 (caching: 1)" in got["2-memcheck.txt"]


@pytest.mark.slow
@pytest.mark.extended   # ~1-2 minutes on 2 cores: pytest -m gpu, the script twice, gpu.py five times
def test_the_real_command_runs_on_the_cpu(gpu, tmp_path):
    """The real programs (only compute-sanitizer is a stub): every gpu test skips, sanitize.py
    runs on the CPU, and each augment run exits 2 for want of CUDA. The limits are wider than
    on the GPU: this machine is slower."""
    env = stubs(tmp_path, None)
    cmd = gpu.correct_command(limits={"tests": 200, "memcheck": 150, "initcheck": 150, "augment": 60})
    subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    got = returned(tmp_path / "out")
    assert sorted(got) == sorted(FILES)
    summary = got["0-summary.txt"]
    assert step_exits(summary) == {"1-gpu-tests": 0, "2-memcheck": 0, "3-initcheck": 0,
                                   **{f"4-augment-run{k}": 2 for k in range(1, gpu.AUGMENT_RUNS + 1)}}, summary
    assert "augment shapes set: exit 0" in summary and summary.rstrip().endswith("all steps ended")
    assert re.search(r"\d+ skipped, \d+ deselected", got["1-gpu-tests.log"])
    assert "<testsuite" in got["1-gpu-tests.xml"]
    assert re.search(r"^sanitize: done on cpu: .* finite True", got["2-memcheck.txt"], re.M), got["2-memcheck.txt"]
    assert re.search(r"^sanitize: done on cpu: .*, no training step \(--no-step\)", got["3-initcheck.txt"],
                     re.M), got["3-initcheck.txt"]                          # initcheck: the augmentation alone
    assert got["4-augment-runs.txt"].count("needs a CUDA GPU") == gpu.AUGMENT_RUNS


@pytest.mark.slow
@pytest.mark.extended   # ~15-25 s on 2 cores: imports, the shapes set, one yolov8n step
def test_sanitize_script_runs_on_the_cpu():
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu" / "sanitize.py"), "--device", "cpu",
                           "--imgsz", "128", "--batch", "4"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.splitlines()[-1]
    assert re.fullmatch(r"sanitize: done on cpu: images \(4, 3, 128, 128\) from uint8, 4 MixUp, loss [0-9.]+, "
                        r"finite True, [0-9.]+ s", last), done.stdout
    assert "device augmentation: images (4, 3, 128, 128)" in done.stdout


def test_a_cuda_error_in_a_section_ends_the_pass_with_its_results(tmp_path):
    """A section that meets a CUDA error (the augment section's device-side assert did): the later
    sections cannot run in that process, so the results are written, the sections left are listed,
    and the process ends with status 1 at once, before the CUDA context's teardown can abort it."""
    import json

    script = f"""
import importlib.util, sys, torch
sys.path[:0] = [{str(BENCHMARKS)!r}]
spec = importlib.util.spec_from_file_location("gpu_pass", {str(BENCHMARKS / "gpu.py")!r})
gpu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu)
def broken(s, clock):
    raise torch.AcceleratorError("CUDA error: device-side assert triggered")
gpu.SECTIONS["precision"] = broken
sys.exit(gpu.main(["--sections", "precision", "checkpointing", "--cpu-smoke", "--out", {str(tmp_path)!r}]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "the device failed in section precision: error: AcceleratorError" in done.stdout
    results = json.loads((tmp_path / "gpu-results.json").read_text())
    assert results["left"] == ["checkpointing"] and results["sections"]["precision"]["rows"][0]["what"] == "error"
