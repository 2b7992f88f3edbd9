#!/usr/bin/env bash
# device_check.sh: everything pyfa needs a GPU for, in one run of 7 minutes.
#
#   tools/device_check.sh --prepare-wheels     # once, on a machine with pip: cffi and
#                                              # pycparser for the GPU machine, into .whl/
#   tools/device_check.sh --dry-run OUTDIR     # anywhere: every step and command, and
#                                              # whether the step timeouts fit the budget
#   tools/device_check.sh OUTDIR               # on the GPU machine (tools/README.md)
#
# Steps, in order: cffi and pycparser importable (else installed from the carried wheels);
# the GPU, driver, nvcc and tools; libpyfa built with CMake for the GPU present; the tests
# that run on the cuda backend (each kernel bit for bit against the simulator; PyTorch and
# CuPy CUDA arrays in and out through DLPack without a host copy, and pyfa.torch's
# gradients, when those libraries import: tests/test_interop.py, tests/test_torch.py);
# compute-sanitizer memcheck, racecheck, initcheck and synccheck on small problems, with
# the emulator's strict mode over the same problems beside them; every op's device entry
# point timed with CUDA events beside PyTorch's SDPA; DRAM bytes per kernel with ncu
# beside pyfa.sim.count_io. OUTDIR gets summary.md (printed last, its tables first),
# summary.json, device_check.log (every step's full output) and pytest.xml: four files.
#
# Every step has a timeout, and all of them share one budget (PYFA_CHECK_BUDGET_S, 420 s),
# so the whole run ends in time; a step that fails or times out is recorded in the summary
# and the next one runs. Standard output stays short (a line per step, the end of a failed
# step's output, then the summary), since the device tool returns only its last 12,000
# characters.
set -u -o pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
WHEELS=$ROOT/.whl
PY=${PYTHON:-python3}
# The wheels the GPU machine's Python (3.12, x86-64, no registry) needs; .whl/ is git-ignored.
WHEEL_SPECS="cffi==2.0.0 pycparser==3.0"
PREPARE_CMD="$PY -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
-d $WHEELS $WHEEL_SPECS"

usage() { echo "usage: $0 [--dry-run] OUTDIR | --prepare-wheels" >&2; exit 2; }
DRY=0
OUTDIR=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --prepare-wheels) echo "+ $PREPARE_CMD"; exec bash -c "$PREPARE_CMD" ;;
    -*) usage ;;
    *) [ -z "$OUTDIR" ] || usage; OUTDIR=$arg ;;
  esac
done
[ -n "$OUTDIR" ] || usage

mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd) || exit 2
WORK=$(mktemp -d "${TMPDIR:-/tmp}/pyfa-device-check.XXXXXX") || exit 2
trap 'rm -rf "$WORK"' EXIT   # its contents end up in OUTDIR/summary.json
LOG=$OUTDIR/device_check.log
: >"$LOG"
: >"$WORK/steps.tsv"
BUILD=${PYFA_BUILD_DIR:-$ROOT/build-device}
SITE=${PYFA_SITE:-/tmp/pyfa-site}
BUDGET=${PYFA_CHECK_BUDGET_S:-420}
SUMMARY_RESERVE=15   # seconds kept back so the summary is always written
# Each step's timeout; together with the reserve they must fit the budget (the dry run
# checks), so that no step is cut short by an earlier one overrunning.
declare -A LIMIT=([wheels]=15 [info]=15 [build]=110 [tests]=90 [sanitizer]=85 [bench]=50 [ncu]=40)
STEPS="wheels info build tests sanitizer bench ncu"
START=$(date +%s)
FAILED=0
# nvcc, ncu and compute-sanitizer live here on CUDA images whose PATH lacks them.
[ -d /usr/local/cuda/bin ] && PATH=$PATH:/usr/local/cuda/bin
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
cd "$ROOT" || exit 2

WHEEL_HELP="cffi and pycparser are needed (pyfa loads libpyfa through cffi) and this machine
cannot install them from a registry. On a machine with pip, in the repository root, run
    tools/device_check.sh --prepare-wheels
and carry .whl with the run (the device tool: carry [\".whl\"]); see tools/README.md."

say() { echo "$*" | tee -a "$LOG"; }

record() {  # record NAME STATUS RC SECONDS TIMEOUT COMMAND
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" "$(echo "$6" | tr '\t\n' '  ')" >>"$WORK/steps.tsv"
}

# step NAME COMMAND [DRY_COMMAND]
# Runs COMMAND under `timeout` (LIMIT[NAME], cut to what is left of the budget), its full
# output into the log and, when it fails, its last lines onto standard output. A dry run
# prints the command instead and runs DRY_COMMAND, if any, which lists what the step
# would do (it needs no GPU).
step() {
  local name=$1 cmd=$2 dry=${3:-}
  local limit=${LIMIT[$name]}
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
  say "== step $name (timeout ${limit}s): $cmd"
  local t0 rc status
  t0=$(date +%s)
  # The Python steps stop starting new work a few seconds before the hard timeout.
  export PYFA_STEP_DEADLINE=$((t0 + limit - 5))
  timeout --kill-after=5 "$limit" bash -c "$cmd" >"$WORK/step.out" 2>&1
  rc=$?
  cat "$WORK/step.out" >>"$LOG"
  case $rc in
    0) status=ok ;;
    124 | 137) status=timeout ;;
    *) status=failed ;;
  esac
  record "$name" "$status" "$rc" $(($(date +%s) - t0)) "$limit" "$cmd"
  if ((rc != 0)); then
    tail -n 15 "$WORK/step.out"
    FAILED=1
  fi
  say "== step $name: $status (rc $rc, $(($(date +%s) - t0)) s)"
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
  echo "== summary ($PY tools/gpu_bench.py summarize --work $WORK --out $OUTDIR --mode $mode)" >>"$LOG"
  "$PY" tools/gpu_bench.py summarize --work "$WORK" --out "$OUTDIR" --mode "$mode" >"$WORK/summary.out" 2>&1
  cat "$WORK/summary.out" >>"$LOG"
  echo ""
  cat "$WORK/summary.out"
}

say "pyfa device check$( ((DRY)) && echo ' (dry run: nothing is built, run or measured)'), $(date -u +%FT%TZ)"
say "repo $ROOT, outputs $OUTDIR, scratch $WORK, budget ${BUDGET}s, python $PY"

if ((DRY)); then
  total=$SUMMARY_RESERVE
  for s in $STEPS; do total=$((total + LIMIT[$s])); done
  fits=$( ((total <= BUDGET)) && echo "fits" || echo "DOES NOT FIT" )
  say "budget: step timeouts $(for s in $STEPS; do printf '%s %ss + ' "$s" "${LIMIT[$s]}"; done)summary reserve ${SUMMARY_RESERVE}s = ${total}s: ${fits} in ${BUDGET}s"
  ((total <= BUDGET)) || exit 1
fi

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

# 1. cffi and pycparser: importable already (the device call installs them), or from the
# carried wheels, or stop here.
WHEELS_CMD="if $PY -c 'import cffi, pycparser' 2>/dev/null; then echo 'cffi and pycparser: already importable'; \
else $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE $WHEELS/*.whl \
&& PYTHONPATH=$SITE $PY -c 'import cffi, pycparser; print(\"cffi\", cffi.__version__, \"and pycparser\", pycparser.__version__, \"installed in $SITE\")'; fi"
have_wheels() { ls "$WHEELS"/cffi-*.whl "$WHEELS"/pycparser-*.whl >/dev/null 2>&1; }
if ((DRY)); then
  step wheels "$WHEELS_CMD"
  if have_wheels; then
    say "wheels ready in $WHEELS: $(cd "$WHEELS" && echo cffi-*.whl pycparser-*.whl)"
  else
    say "wheels MISSING in $WHEELS: unless the GPU machine's python can import cffi, the real run stops here."
    say "$WHEEL_HELP"
  fi
elif ! "$PY" -c 'import cffi, pycparser' 2>/dev/null && ! have_wheels; then
  say "$WHEEL_HELP"
  record wheels "failed: wheels missing" 3 0 0 "$WHEELS_CMD"
  summarize
  exit 3
else
  step wheels "$WHEELS_CMD" || { say "$WHEEL_HELP"; summarize; exit 3; }
fi
export PYTHONPATH=$PYTHONPATH:$SITE

# 2. What we run on.
step info "$PY tools/gpu_bench.py info --out $WORK/info.json"

# 3. Build for this GPU, then make sure the library sees it.
BUILD_CMD="cmake -S . -B $BUILD -DCMAKE_BUILD_TYPE=Release -DPYFA_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$ARCH \
&& cmake --build $BUILD -j $(nproc) \
&& PYFA_LIBRARY=$BUILD/libpyfa.so $PY -c 'import pyfa; b = pyfa.backends(); print(\"backends:\", b, pyfa.unavailable_backends()); \
assert \"cuda\" in b, \"libpyfa sees no usable GPU\"; print(pyfa.device_profile(\"cuda\"))'"
if step build "$BUILD_CMD"; then
  export PYFA_LIBRARY=$BUILD/libpyfa.so
  BUILT=1
else
  BUILT=0
fi

# 4-7. On the GPU. Only the tests that run the cuda backend: the rest need no GPU and
# run everywhere else.
TEST_CMD="$PY -m pytest -q -rfEs -p no:cacheprovider -k cuda --junitxml=$OUTDIR/pytest.xml tests"
if ((BUILT || DRY)); then
  step tests "$TEST_CMD"
  step sanitizer "$PY tools/gpu_bench.py sanitize --out $WORK/sanitize.json" \
    "$PY tools/gpu_bench.py sanitize --dry-run"
  step bench "$PY tools/gpu_bench.py bench --out $WORK/bench.json" \
    "$PY tools/gpu_bench.py bench --dry-run"
  step ncu "$PY tools/gpu_bench.py ncu --out $WORK/ncu.json" \
    "$PY tools/gpu_bench.py ncu --dry-run"
else
  for s in tests sanitizer bench ncu; do skip "$s" "the build failed"; done
fi

say "device_check: $( ((DRY)) && echo 'dry run done; on a GPU these steps would run as listed' || { ((FAILED)) && echo 'some steps failed or were skipped' || echo 'all steps ok'; }); outputs in $OUTDIR"
summarize
((DRY)) && exit 0
exit "$FAILED"
