#!/usr/bin/env bash
# The GPU check: every test (CPU and GPU), compute-sanitizer memcheck + racecheck
# + synccheck + initcheck on a representative subset, the benchmarks, the training demo and
# the notebooks; prints a summary at the end.
# With 2 or more GPUs visible it also runs the 2-GPU checks (step multigpu: tests/gpu/test_multidevice_gpu.py;
# step multigpu_bench: scripts/multigpu_bench.py, JAX token-sharded layer and demo tokens/s, 1 vs 2 GPUs).
# Usage (repo root, on a CUDA machine):  bash scripts/gpu_check.sh [OUT_DIR]
# Knobs: GPU_CHECK_PYTEST_ARGS (default: -v -rf tests), GPU_CHECK_BENCH_ARGS,
# GPU_CHECK_BENCH_LAYER_ARGS, GPU_CHECK_BENCH_BLOCK_ARGS (the --layer / --block runs),
# GPU_CHECK_MULTIGPU_ARGS (scripts/multigpu_bench.py),
# GPU_CHECK_DEMO_ARGS (default: --baseline), GPU_CHECK_WORKERS (pytest-xdist), GPU_CHECK_TESTS_PART (k/N: a share
# of the test files, below),
# GPU_CHECK_STEPS (names of the steps to run), GPU_CHECK_NOTEBOOKS, GPU_CHECK_STEP_TIMEOUT (s).
# Runs from the checkout (PYTHONPATH), no install needed.  Exit status is
# non-zero if any step failed.
set -u -o pipefail
OUT=${1:-${OUT:-gpu_check_out}}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MHC_CUPY_CACHE_DIR=${MHC_CUPY_CACHE_DIR:-$OUT/kernel_cache}
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX must not take 75% of the GPU in each process
PY=${PYTHON:-python3}
declare -A status

STEPS=" ${GPU_CHECK_STEPS:-info warmup tests memcheck racecheck synccheck initcheck demo bench bench_layer bench_block notebooks multigpu multigpu_bench} "
NGPU=$($PY -c "import cupy; print(cupy.cuda.runtime.getDeviceCount())" 2>/dev/null || echo 0)
MULTI_IGNORE=""
if [ "$NGPU" -ge 2 ]; then  # the 2-GPU tests run in their own step (serially, not under xdist)
    MULTI_IGNORE="--ignore=tests/gpu/test_multidevice_gpu.py"
fi
step() {  # step NAME COMMAND...   (skipped unless NAME is in GPU_CHECK_STEPS)
    local name=$1; shift
    case "$STEPS" in *" $name "*) ;; *) return 0 ;; esac
    echo "=== $name: $*"
    local t0=$SECONDS
    timeout "${GPU_CHECK_STEP_TIMEOUT:-3600}" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    status[$name]="rc=$rc ($((SECONDS - t0)) s)"
    tail -n 15 "$OUT/$name.log"
}

step info $PY -m mhc_cupy info
step warmup $PY -m mhc_cupy warmup --dtypes bfloat16 --n 4  # the rest compiles in parallel in the tests
XDIST=""
$PY -c "import xdist" 2>/dev/null && XDIST="-n ${GPU_CHECK_WORKERS:-8}"
# GPU_CHECK_TESTS_PART=k/N: only every N-th test file from the k-th (1-based, sorted paths), for
# runs whose time limit the whole suite exceeds (e.g. 1/2 and 2/2 in two calls)
TEST_PATHS=tests
if [ -n "${GPU_CHECK_TESTS_PART:-}" ]; then
    PART_K=${GPU_CHECK_TESTS_PART%/*} PART_N=${GPU_CHECK_TESTS_PART#*/}
    if ! [[ "$GPU_CHECK_TESTS_PART" =~ ^[0-9]+/[0-9]+$ ]] || [ "$PART_K" -lt 1 ] || [ "$PART_K" -gt "$PART_N" ]; then
        echo "GPU_CHECK_TESTS_PART must be k/N with 1 <= k <= N, got '$GPU_CHECK_TESTS_PART'" >&2
        exit 2
    fi
    TEST_PATHS=$(find tests -name 'test_*.py' | sort | awk -v k="$PART_K" -v N="$PART_N" '(NR - k) % N == 0' | tr '\n' ' ')
    [ -n "$MULTI_IGNORE" ] && TEST_PATHS=$(echo "$TEST_PATHS" | tr ' ' '\n' | grep -v test_multidevice_gpu.py | tr '\n' ' ')
    if [ -z "${TEST_PATHS// /}" ]; then  # (pytest would run its testpaths: the whole suite)
        echo "GPU_CHECK_TESTS_PART=$GPU_CHECK_TESTS_PART selects no test file" >&2
        exit 2
    fi
fi
# -v: every result on its own line as it happens, so a run cut off by the step timeout still names its failures
export MHC_TEST_FAILURES="$OUT/test_failures.txt"  # each failure's traceback as it happens (tests/conftest.py)
rm -f "$MHC_TEST_FAILURES"
step tests $PY -m pytest -p no:cacheprovider $XDIST ${GPU_CHECK_PYTEST_ARGS:--v -rf $TEST_PATHS $MULTI_IGNORE}
if command -v compute-sanitizer > /dev/null; then
    step memcheck compute-sanitizer --tool memcheck --error-exitcode 9 $PY scripts/sanitize_subset.py
    step racecheck compute-sanitizer --tool racecheck --error-exitcode 9 $PY scripts/sanitize_subset.py
    # an intra-warp hazard is a racecheck warning, which --error-exitcode ignores
    if [ -n "${status[racecheck]:-}" ] && grep -qE "RACECHECK SUMMARY: [1-9]" "$OUT/racecheck.log" 2>/dev/null; then
        status[racecheck]="hazards reported (warnings count too, see racecheck.log): ${status[racecheck]}"
    fi
    step synccheck compute-sanitizer --tool synccheck --error-exitcode 9 $PY scripts/sanitize_subset.py
    # reads of device memory that no one wrote (e.g. unused slots of a scratch buffer)
    step initcheck compute-sanitizer --tool initcheck --error-exitcode 9 $PY scripts/sanitize_subset.py
else
    status[sanitizer]="compute-sanitizer not found"
fi
step demo $PY -m mhc_cupy.demo ${GPU_CHECK_DEMO_ARGS:---baseline} --out "$OUT/demo"
step bench $PY -m mhc_cupy.bench ${GPU_CHECK_BENCH_ARGS:-} --out "$OUT/bench"
step bench_layer $PY -m mhc_cupy.bench --layer ${GPU_CHECK_BENCH_LAYER_ARGS:-} --out "$OUT/bench"
step bench_block $PY -m mhc_cupy.bench --block ${GPU_CHECK_BENCH_BLOCK_ARGS:-} --out "$OUT/bench"
step notebooks $PY scripts/run_notebooks.py ${GPU_CHECK_NOTEBOOKS:-notebooks/*.ipynb}
if [ "$NGPU" -ge 2 ]; then
    step multigpu $PY -m pytest -p no:cacheprovider -v -rs -s tests/gpu/test_multidevice_gpu.py
    step multigpu_bench $PY scripts/multigpu_bench.py ${GPU_CHECK_MULTIGPU_ARGS:-} --out "$OUT/multigpu"
else
    status[multigpu]="skipped: $NGPU GPU(s) visible, needs 2"
fi

echo
echo "================ gpu_check summary ================"
rc=0
for k in info warmup tests memcheck racecheck synccheck initcheck sanitizer bench bench_layer bench_block demo notebooks multigpu multigpu_bench; do
    [ -n "${status[$k]:-}" ] || continue
    echo "$k: ${status[$k]}"
    case "${status[$k]}" in rc=0* | skipped:*) ;; *) rc=1 ;; esac
done
grep -E "passed|failed" "$OUT/tests.log" | tail -n 1
grep -E "^\[gw[0-9]+\].* (FAILED|ERROR) |^(FAILED|ERROR) " "$OUT/tests.log" 2>/dev/null | head -n 40
grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT"/{memcheck,racecheck,synccheck,initcheck}.log 2>/dev/null
exit $rc
