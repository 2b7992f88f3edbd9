#!/usr/bin/env bash
# device_check.sh: everything pyfa needs a GPU for, in one run of under 8 minutes.
#
#   tools/device_check.sh OUTDIR             # on a machine with a CUDA GPU
#   tools/device_check.sh --dry-run OUTDIR   # anywhere: prints every step and command
#
# Steps, in order: install the carried cffi/pycparser wheels; print the GPU, driver, nvcc
# and tools; build libpyfa with CMake for the GPU present; run the test suite (each kernel
# on the cuda backend bit for bit against the simulator); compute-sanitizer memcheck and
# racecheck on small problems; time every forward and backward entry point with CUDA
# events beside PyTorch's SDPA; DRAM bytes per kernel with ncu beside pyfa.sim.count_io;
# the ptxas report; then OUTDIR/summary.json and OUTDIR/summary.md (OUTDIR also gets
# device_check.log and pytest.xml).
#
# Every step has a timeout, and all of them share one budget (PYFA_CHECK_BUDGET_S, 450 s),
# so the whole run ends in time; a step that fails or times out is recorded in the summary
# and the next one runs. The GPU machine reaches no package registry: see WHEEL_HELP below
# and tools/README.md for how the wheels are prepared and carried.
set -u -o pipefail

usage() { echo "usage: $0 [--dry-run] OUTDIR" >&2; exit 2; }
DRY=0
OUTDIR=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    -*) usage ;;
    *) [ -z "$OUTDIR" ] || usage; OUTDIR=$arg ;;
  esac
done
[ -n "$OUTDIR" ] || usage

ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd) || exit 2
WORK=$(mktemp -d "${TMPDIR:-/tmp}/pyfa-device-check.XXXXXX") || exit 2
trap 'rm -rf "$WORK"' EXIT   # its contents end up in OUTDIR/summary.json
LOG=$OUTDIR/device_check.log
: >"$LOG"
: >"$WORK/steps.tsv"
PY=${PYTHON:-python3}
BUILD=${PYFA_BUILD_DIR:-$ROOT/build-device}
SITE=${PYFA_SITE:-/tmp/pyfa-site}
WHEELS=$ROOT/.whl
BUDGET=${PYFA_CHECK_BUDGET_S:-450}
SUMMARY_RESERVE=20   # seconds kept back so the summary is always written
START=$(date +%s)
FAILED=0
# nvcc, ncu and compute-sanitizer live here on CUDA images whose PATH lacks them.
[ -d /usr/local/cuda/bin ] && PATH=$PATH:/usr/local/cuda/bin
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
cd "$ROOT" || exit 2

WHEEL_HELP="cffi and pycparser are needed (pyfa loads libpyfa through cffi) and this machine
cannot install them from a registry. Prepare them as wheels for the GPU machine's Python
(3.12) on a machine with pip, in the repository root:
    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \\
        --platform manylinux2014_x86_64 -d .whl cffi==2.0.0 pycparser==3.0
then carry .whl with the run (the device tool: carry [\".whl\"]). This script installs them with
    $PY -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE .whl/*.whl"

say() { echo "$*" | tee -a "$LOG"; }

record() {  # record NAME STATUS RC SECONDS TIMEOUT COMMAND
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" "$(echo "$6" | tr '\t\n' '  ')" >>"$WORK/steps.tsv"
}

# step NAME TIMEOUT COMMAND [DRY_COMMAND]
# Runs COMMAND under `timeout`, its output into the log; in a dry run prints it instead and
# runs DRY_COMMAND, if any, which lists what the step would do (it needs no GPU).
step() {
  local name=$1 limit=$2 cmd=$3 dry=${4:-}
  local left=$((START + BUDGET - SUMMARY_RESERVE - $(date +%s)))
  ((limit > left)) && limit=$left
  if ((DRY)); then
    say ""
    say "== step $name (timeout ${limit}s): $cmd"
    if [ -n "$dry" ]; then
      bash -c "$dry" 2>&1 | tee -a "$LOG"
    fi
    record "$name" "dry-run" "-" 0 "$limit" "$cmd"
    return 0
  fi
  if ((limit < 5)); then
    say "== step $name: skipped, the time budget is spent"
    record "$name" "skipped: time budget" "-" 0 "$limit" "$cmd"
    FAILED=1
    return 1
  fi
  say ""
  say "== step $name (timeout ${limit}s): $cmd"
  local t0 rc status
  t0=$(date +%s)
  # The Python steps stop starting new work a few seconds before the hard timeout.
  export PYFA_STEP_DEADLINE=$((t0 + limit - 5))
  timeout --kill-after=10 "$limit" bash -c "$cmd" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) status=ok ;;
    124 | 137) status=timeout ;;
    *) status=failed ;;
  esac
  record "$name" "$status" "$rc" $(($(date +%s) - t0)) "$limit" "$cmd"
  say "== step $name: $status (rc $rc, $(($(date +%s) - t0)) s)"
  ((rc == 0)) || FAILED=1
  return "$rc"
}

skip() {  # skip NAME REASON
  say "== step $1: skipped, $2"
  record "$1" "skipped: $2" "-" 0 0 "-"
  FAILED=1
}

summarize() {
  local mode=gpu
  ((DRY)) && mode=dry-run
  say ""
  say "== step summary: $PY tools/gpu_bench.py summarize --work $WORK --out $OUTDIR --mode $mode"
  "$PY" tools/gpu_bench.py summarize --work "$WORK" --out "$OUTDIR" --mode "$mode" 2>&1 | tee -a "$LOG"
}

say "pyfa device check$( ((DRY)) && echo ' (dry run: nothing is built, run or measured)'), $(date -u +%FT%TZ)"
say "repo $ROOT, outputs $OUTDIR, scratch $WORK, budget ${BUDGET}s, python $PY"

# The GPU's compute capability picks the one architecture to build (90 on an H100/H200).
ARCH=""
if command -v nvidia-smi >/dev/null 2>&1; then
  ARCH=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' .')
fi
case $ARCH in
  '' | *[!0-9]*)
    if ((DRY)); then ARCH=90; say "(dry run: assuming compute capability 9.0; the real run reads nvidia-smi)"
    else ARCH=native; fi ;;
esac
PTX_ARCH=sm_$ARCH
[ "$ARCH" = native ] && PTX_ARCH=sm_90

# 1. cffi and pycparser: importable already, or from the carried wheels, or stop here.
WHEELS_CMD="if $PY -c 'import cffi, pycparser' 2>/dev/null; then echo 'cffi and pycparser: already importable'; \
else $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE $WHEELS/*.whl \
&& PYTHONPATH=$SITE $PY -c 'import cffi, pycparser; print(\"cffi\", cffi.__version__, \"and pycparser\", pycparser.__version__, \"installed in $SITE\")'; fi"
have_wheels() { ls "$WHEELS"/cffi-*.whl "$WHEELS"/pycparser-*.whl >/dev/null 2>&1; }
if ((DRY)); then
  step wheels 60 "$WHEELS_CMD"
  if have_wheels; then
    say "wheels ready in $WHEELS: $(cd "$WHEELS" && echo cffi-*.whl pycparser-*.whl)"
  else
    say "wheels MISSING in $WHEELS: unless the GPU machine's python can import cffi, the real run stops here with:"
    say "$WHEEL_HELP"
  fi
elif ! "$PY" -c 'import cffi, pycparser' 2>/dev/null && ! have_wheels; then
  say "$WHEEL_HELP"
  record wheels "failed: wheels missing" 3 0 0 "$WHEELS_CMD"
  summarize
  exit 3
else
  step wheels 60 "$WHEELS_CMD" || { say "$WHEEL_HELP"; summarize; exit 3; }
fi
export PYTHONPATH=$SITE:$PYTHONPATH

# 2. What we run on.
step info 30 "$PY tools/gpu_bench.py info --out $WORK/info.json"

# 3. Build for this GPU, then make sure the library sees it.
BUILD_CMD="cmake -S . -B $BUILD -DCMAKE_BUILD_TYPE=Release -DPYFA_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$ARCH \
&& cmake --build $BUILD -j $(nproc) \
&& PYFA_LIBRARY=$BUILD/libpyfa.so $PY -c 'import pyfa; b = pyfa.backends(); print(\"backends:\", b); \
assert \"cuda\" in b, \"libpyfa sees no usable GPU (built without nvcc?)\"; print(pyfa.device_profile(\"cuda\"))'"
if step build 150 "$BUILD_CMD"; then
  export PYFA_LIBRARY=$BUILD/libpyfa.so
  BUILT=1
else
  BUILT=0
fi

# 4-7. On the GPU.
XDIST=""
"$PY" -c 'import xdist' 2>/dev/null && XDIST="-n 8"
TEST_CMD="$PY -m pytest -q -rfEs -p no:cacheprovider $XDIST --junitxml=$OUTDIR/pytest.xml tests"
if ((BUILT || DRY)); then
  step tests 120 "$TEST_CMD"
  step sanitizer 90 "$PY tools/gpu_bench.py sanitize --out $WORK/sanitize.json" \
    "$PY tools/gpu_bench.py sanitize --dry-run"
  step bench 150 "$PY tools/gpu_bench.py bench --out $WORK/bench.json" \
    "$PY tools/gpu_bench.py bench --dry-run"
  step ncu 90 "$PY tools/gpu_bench.py ncu --out $WORK/ncu.json" \
    "$PY tools/gpu_bench.py ncu --dry-run"
else
  for s in tests sanitizer bench ncu; do skip "$s" "the build failed"; done
fi

# 8. Registers and spills: needs nvcc only.
step ptxas 45 "$PY tools/ptxas_report.py --arch $PTX_ARCH --json $WORK/ptxas.json"

summarize
if ((DRY)); then
  say "device_check: dry run done; on a GPU these steps would run as listed"
  exit 0
fi
say "device_check: $( ((FAILED)) && echo 'some steps failed or were skipped' || echo 'all steps ok'); outputs in $OUTDIR"
exit "$FAILED"
