#!/usr/bin/env bash
# The test suite on one torch / torchvision pair, in a fresh venv of its own.
#
#   benchmarks/compat.sh 2.11.0 0.26.0       # the GPU machine's pair (the oldest supported)
#   benchmarks/compat.sh 2.15.0 0.29.2       # the newest release
#
# The checkout is copied (git worktree at HEAD) so that the run does not see later edits.
# Prints the versions and pytest's summary line; the log is in /tmp/compat-<torch>/pytest.log.
# PIP_CONFIG_FILE=/dev/null lifts a machine-wide pip constraint that caps torch (set it yourself
# if your machine has one). Results go to BENCHMARKS.md, section "Supported torch versions".
set -euo pipefail
torch_version=${1:?torch version}; vision_version=${2:?torchvision version}
root=$(cd "$(dirname "$0")/.." && pwd)
work=/tmp/compat-$torch_version
rm -rf "$work" && mkdir -p "$work"
git -C "$root" worktree add -f --detach "$work/src" HEAD >/dev/null
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q "torch==$torch_version" "torchvision==$vision_version"
"$work/venv/bin/pip" install -q -e "$work/src[dev]"
"$work/venv/bin/python" -c "import sys, torch, torchvision; print(sys.version.split()[0], torch.__version__, torchvision.__version__)"
cd "$work/src"
code=0
"$work/venv/bin/python" -m pytest -q -p no:cacheprovider > "$work/pytest.log" 2>&1 || code=$?
tail -n 1 "$work/pytest.log"
git -C "$root" worktree remove --force "$work/src" >/dev/null 2>&1 || true
exit "$code"
