#!/usr/bin/env bash
# The test suite as a newcomer meets it: a fresh clone and a fresh venv, Quick start command 2, timed; or
# the line and branch coverage of src/yolokit by the same default run. Results go to BENCHMARKS.md,
# section "Test suite".
#
#   benchmarks/suite.sh time [RUNS] [REF]     # RUNS fresh runs (default 3): each wall time, the median, the
#                                             # 30 slowest tests of the median run
#   benchmarks/suite.sh coverage [REF]        # coverage.py, branch on, subprocesses and spawned ranks included
#
# SUITE_DURATIONS=0 keeps every test's duration in the log (default: the 30 slowest), to compare two trees
# file by file. REF is a commit of this checkout (default HEAD); each run clones it into /tmp/suite-<REF>/
# (only its logs are kept: SUITE_KEEP=1 keeps the clone, its venv and caches too). Nothing of
# this machine's caches is reused: a fresh torch inductor cache and yolokit cache per run (a fresh machine
# has neither). Time nothing else on the machine meanwhile.
set -euo pipefail
mode=${1:?"time or coverage"}
root=$(cd "$(dirname "$0")/.." && pwd)

fresh() {   # fresh <ref> <dir>: a clone at <ref> and a venv with the dev extra, as Quick start command 2
  local ref=$1 dir=$2
  rm -rf "$dir" && mkdir -p "$dir"
  git clone -q "$root" "$dir/src" && git -C "$dir/src" checkout -q "$ref"
  python3 -m venv "$dir/venv"
  local start=$(date +%s)
  (cd "$dir/src" && "$dir/venv/bin/python" -m pip install -q -e ".[dev]" > "$dir/install.log" 2>&1)
  echo "install: $(( $(date +%s) - start )) s"
}

isolated() {   # isolated <dir> <command...>: with caches of its own
  local dir=$1; shift
  (cd "$dir/src" && env TORCHINDUCTOR_CACHE_DIR="$dir/inductor" YOLOKIT_CACHE="$dir/yolokit-cache" "$@")
}

case "$mode" in
  time)
    runs=${2:-3}; ref=$(git -C "$root" rev-parse --short "${3:-HEAD}")
    walls=()
    for i in $(seq 1 "$runs"); do
      dir=/tmp/suite-$ref/run$i
      fresh "$ref" "$dir"
      start=$(date +%s)
      code=0
      isolated "$dir" "$dir/venv/bin/python" -m pytest -q --durations="${SUITE_DURATIONS:-30}" \
        > "$dir/pytest.log" 2>&1 || code=$?
      wall=$(( $(date +%s) - start ))
      walls+=("$wall")
      echo "run $i: ${wall} s, exit code ${code}: $(tail -n 1 "$dir/pytest.log")"
      # 7 GB a run (the venv, the caches): runs left behind filled this machine's disk until the test
      # store (SeaweedFS) found no room for a new bucket's volume. SUITE_KEEP=1 keeps them.
      [ "${SUITE_KEEP:-0}" = 1 ] || rm -rf "$dir/venv" "$dir/inductor" "$dir/yolokit-cache" "$dir/src"
    done
    sorted=($(printf '%s\n' "${walls[@]}" | sort -n))
    median=${sorted[$(( runs / 2 ))]}
    echo "median: ${median} s of ${walls[*]} (ref ${ref}, $(nproc) CPUs)"
    for i in $(seq 1 "$runs"); do
      if [ "${walls[$((i - 1))]}" = "$median" ]; then
        echo "the 30 slowest of run $i:"
        sed -n '/slowest 30 durations/,/^=/p' "/tmp/suite-$ref/run$i/pytest.log" | grep -E '^[0-9.]+s'
        break
      fi
    done
    ;;
  coverage)
    ref=$(git -C "$root" rev-parse --short "${2:-HEAD}")
    dir=/tmp/suite-$ref/coverage
    fresh "$ref" "$dir"
    "$dir/venv/bin/python" -m pip install -q "coverage>=7.10"
    cat > "$dir/coveragerc" <<EOF
[run]
branch = True
source_pkgs = yolokit
parallel = True
data_file = $dir/data/.coverage
concurrency = thread,multiprocessing
patch = subprocess,_exit
EOF
    mkdir -p "$dir/data"
    code=0
    isolated "$dir" "$dir/venv/bin/python" -m coverage run --rcfile="$dir/coveragerc" -m pytest -q \
      > "$dir/pytest.log" 2>&1 || code=$?
    echo "pytest: exit code ${code}: $(tail -n 1 "$dir/pytest.log")"
    (cd "$dir/src" && "$dir/venv/bin/python" -m coverage combine --rcfile="$dir/coveragerc" -q "$dir/data" \
      && "$dir/venv/bin/python" -m coverage json --rcfile="$dir/coveragerc" -q -o "$dir/coverage.json")
    "$dir/venv/bin/python" - "$dir/coverage.json" <<'EOF'
import json, sys
t = json.load(open(sys.argv[1]))["totals"]
print(f"lines {t['covered_lines']} of {t['num_statements']} ({100 * t['covered_lines'] / t['num_statements']:.2f}%), "
      f"branches {t['covered_branches']} of {t['num_branches']} "
      f"({100 * t['covered_branches'] / t['num_branches']:.2f}%): {sys.argv[1]}")
EOF
    ;;
  *)
    echo "usage: benchmarks/suite.sh time [RUNS] [REF] | coverage [REF]" >&2
    exit 2
    ;;
esac
