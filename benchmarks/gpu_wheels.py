"""Fetch, here, the wheels the GPU pass needs beyond the GPU machine's own packages; print the plan.

    python benchmarks/gpu_wheels.py            # into .whl/ (ignored by git; the device tool carries it)

The GPU machine has no package index. Its image (Python 3.12, torch 2.11, torchvision 0.26)
already holds what yolokit and its tests need there: numpy, opencv-python-headless, pillow,
pyyaml, tqdm, safetensors, matplotlib, tensorboard, nvidia-ml-py, pytest. It lacks
pycocotools and albumentations, which the pass does not use (the array COCOeval is the
default evaluator), and the reference: Ultralytics and the two small packages it imports
at start. polars, which it imports only to read results files, is not carried (its runtime
is a 54 MB wheel, most of the 64 MiB a device call may carry).

The wheels are CPython 3.12 manylinux x86-64 builds (pure Python here), downloaded without
their dependencies; the reference is installed there into a folder of its own, so it runs
in an environment of its own (``gpu.py --plan`` prints the commands).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = {"ultralytics": "8.4.190", "ultralytics-thop": "2.2.3", "ultralytics-platform": "0.1.99"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")


def download_command(dest: Path, requirements: list[str]) -> list[str]:
    """The ``pip download`` of cp312 manylinux wheels, without dependencies, into ``dest``."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
            "--implementation", "cp", *platforms, "-d", str(dest), *requirements]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=ROOT / ".whl", help="folder of the wheels (default: .whl/)")
    parser.add_argument("--dry-run", action="store_true", help="print the download command only")
    args = parser.parse_args(argv)
    requirements = [f"{name}=={version}" for name, version in REFERENCE.items()]
    cmd = download_command(args.dest, requirements)
    print(" ".join(cmd))
    if args.dry_run:
        return 0
    args.dest.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stderr[-2000:], file=sys.stderr)
        return 1
    wheels = sorted(args.dest.glob("*.whl"))
    names = {w.name.split("-")[0].replace("_", "-").lower() for w in wheels}
    missing = sorted(set(REFERENCE) - names)
    if missing:
        print(f"not downloaded: {', '.join(missing)}", file=sys.stderr)
        return 1
    size = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels, {size / 2**20:.1f} MiB in {args.dest}: " + ", ".join(w.name for w in wheels))
    print("\nThe pass, as device commands (python benchmarks/gpu.py --plan):")
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--plan"]).returncode


if __name__ == "__main__":
    sys.exit(main())
