#!/usr/bin/env bash
# A short GPU round for sessions with little device time: one part per device call (each bounded by
# BUDGET seconds, default 570, most important step first; what a step leaves unfinished is cut, and
# the part's logs are packed into OUT/<part>.tar.gz even then).  scripts/gpu_check.sh is the full check.
#   check    GPU tests (tests/gpu, test_bench_small.py; 16 workers), compute-sanitizer memcheck /
#            racecheck / initcheck / synccheck on scripts/sanitize_subset.py --opt-in (the off-by-default
#            kernels; gpu_check.sh runs the whole subset)
#   small    bench --small (kernel choices small and tail against the default), the boundary A/B (ab_kernels.py boundary)
#   bench    bench --stack with the fused boundary kernel (both configs; its fused bwd rows: the backward A/B), the narrow column sum's cost
#   profile  scripts/profile_stack.py and profile_layer.py (n = 4, 8, 16), the _MMA_TARGET_BLOCKS A/B
#   suite    the test files outside tests/gpu (the rest of the GPU suite; -v: cut runs still name failures)
#   ncu      Nsight Compute (full set, source counters) of the layer backward's slowest kernels at 8192 x 2048 x 4
#            (scripts/ncu_driver.py); the kernel times of a decode-sized forward (profile_layer.py, T 1 / 64),
#            its host time (profile_host.py), the post backward A/B, JAX mhc_stack's scaling with tokens
#   quick    the A/Bs of ncu without Nsight Compute (the decode-sized forward's variants and GEMM splits, post
#            backward, n = 4 wgmma forward, JAX scaling), the host overhead per call (profile_host.py --layer), then
#            bench --small
# Usage (repo root, on a CUDA machine):  BUDGET=570 bash scripts/gpu_round.sh check [OUT_DIR]
set -u -o pipefail
PART=${1:?part: check, small, bench, profile, suite, ncu or quick}
OUT=${2:-${OUT:-gpu_round_out}}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export MHC_CUPY_CACHE_DIR=${MHC_CUPY_CACHE_DIR:-/tmp/mhc_kernel_cache}  # kept between calls on a warm machine
PY=${PYTHON:-python3}
T0=$SECONDS B=${BUDGET:-570} R=$(mktemp -d)
left() { echo $(( B - (SECONDS - T0) - ${1:-0} )); }  # seconds left, keeping $1 for what follows
cap() { local l; l=$(left "$2"); [ "$l" -lt 1 ] && l=1; [ "$1" -lt "$l" ] && echo "$1" || echo "$l"; }  # >= 1 (timeout 0: none)
trap 'tar czf "$OUT/$PART.tar.gz" -C "$R" .' EXIT
export MHC_TEST_FAILURES=$R/test_failures.txt  # each failure's traceback as it happens (tests/conftest.py)
case "$PART" in
check)
    nvidia-smi --query-gpu=name,clocks.max.sm --format=csv | tee "$R/info.txt"
    $PY -m mhc_cupy warmup --dtypes bfloat16 --n 4 > "$R/warmup.log" 2>&1; echo "warmup rc=$? $((SECONDS - T0)) s"
    timeout "$(cap 290 0)" $PY -m pytest -p no:cacheprovider -n 16 -v -rf tests/gpu tests/test_bench_small.py \
        > "$R/tests.log" 2>&1
    echo "tests rc=$? $((SECONDS - T0)) s"; grep -E "passed|failed" "$R/tests.log" | tail -n 1
    grep -E "(FAILED|ERROR) " "$R/tests.log" | head -n 30
    # the off-by-default kernels under the four sanitizers; their specialisations compiled first, without a
    # sanitizer (compiling under one took the whole 60 s of each on the 2026-12-06 run)
    timeout "$(cap 60 120)" $PY scripts/sanitize_subset.py --opt-in > "$R/sanitize_plain.log" 2>&1
    echo "sanitize subset (compile) rc=$? $((SECONDS - T0)) s"
    for tool in memcheck racecheck initcheck synccheck; do
        l=$(cap 60 5); [ "$l" -lt 20 ] && { echo "$tool: no time left"; continue; }
        timeout "$l" compute-sanitizer --tool $tool --error-exitcode 9 $PY scripts/sanitize_subset.py --opt-in \
            > "$R/$tool.log" 2>&1
        echo "$tool rc=$? $((SECONDS - T0)) s"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|sanitize subset" "$R/$tool.log"
    done ;;
small)
    timeout "$(cap 45 0)" $PY scripts/ab_kernels.py boundary 2>&1 | tee "$R/ab_boundary.log"
    l=$(left 5); [ "$l" -gt 30 ] && timeout "$l" $PY -m mhc_cupy.bench --small --out "$R/small" > "$R/small.log" 2>&1
    echo "small rc=$? $((SECONDS - T0)) s"; grep -v "^$" "$R/small/small.md" 2>/dev/null | head -n 40 ;;
bench)
    timeout "$(left 40)" $PY -m mhc_cupy.bench --stack --reps 10 --choose boundary=true --out "$R/stack" \
        > "$R/stack.log" 2>&1
    echo "stack rc=$? $((SECONDS - T0)) s"; grep -v "^$" "$R/stack/stack.md" 2>/dev/null | head -n 50
    timeout "$(cap 30 0)" $PY scripts/ab_kernels.py colsum 2>&1 | tee "$R/ab_colsum.log" ;;
profile)
    timeout "$(cap 200 0)" $PY scripts/profile_stack.py --config 8:2048:16:5504:4:2048 --steps 5 --rows 30 \
        --variants plain,MHCStack,"MHCStack fused" --choose boundary=true,boundary_bwd=true > "$R/profile_stack.log" 2>&1
    tail -n 60 "$R/profile_stack.log" | cut -c1-160
    timeout "$(cap 150 0)" $PY scripts/profile_layer.py --shapes 16384x4096x4,16384x2048x8,8192x1024x16 --rows 16 \
        > "$R/profile_layer.log" 2>&1
    tail -n 100 "$R/profile_layer.log" | cut -c1-150
    for k in 1024 792 1584 2048; do
        timeout "$(cap 30 5)" $PY scripts/ab_kernels.py bwd $k 2>&1
    done | tee "$R/ab_bwd.log" ;;
suite)
    timeout "$(left 10)" $PY -m pytest -p no:cacheprovider -n 16 -v -rf tests --ignore=tests/gpu > "$R/suite.log" 2>&1
    echo "suite rc=$? $((SECONDS - T0)) s"; grep -E "passed|failed" "$R/suite.log" | tail -n 1
    grep -E "(FAILED|ERROR) " "$R/suite.log" | head -n 40 ;;
ncu)
    K='regex:mhc_coeffs_mma_bwd_kernel|mhc_stream_mix_distribute_bwd|mhc_coeffs_mma_fwd'
    timeout "$(cap 240 200)" ncu --clock-control none -k "$K" --launch-skip 3 --launch-count 3 --set full \
        --import-source yes -o "$R/layer" $PY scripts/ncu_driver.py 8192 2048 4 --reps 4 > "$R/ncu_run.log" 2>&1
    echo "ncu rc=$? $((SECONDS - T0)) s"; tail -n 5 "$R/ncu_run.log"
    timeout "$(cap 60 150)" ncu --import "$R/layer.ncu-rep" --page details > "$R/ncu_details.txt" 2>&1
    timeout "$(cap 60 150)" ncu --import "$R/layer.ncu-rep" --page source --csv --print-source sass \
        > "$R/ncu_source.csv" 2>&1
    grep -E "^  [a-z_]+.*\(|Duration|Throughput|Registers|Achieved Occupancy|Issue Slots|Stall|Warp Cycles|No Eligible" \
        "$R/ncu_details.txt" | head -n 120; rm -f "$R/layer.ncu-rep"
    for ch in "" small=true tail=true; do
        timeout "$(cap 40 0)" $PY scripts/profile_layer.py --shapes 1x7168x4,64x7168x4 --rows 10 --choose "$ch" \
            >> "$R/profile_small.log" 2>&1
    done
    grep -v "^USDT\|^ *$" "$R/profile_small.log" | cut -c1-150 | head -n 130
    timeout "$(cap 40 0)" $PY scripts/profile_host.py --profile --layer > "$R/profile_host.log" 2>&1
    head -n 8 "$R/profile_host.log"
    timeout "$(cap 40 0)" $PY scripts/ab_kernels.py postbwd 2>&1 | tee "$R/ab_postbwd.log"
    timeout "$(cap 30 0)" $PY scripts/ab_kernels.py wgfwd 2>&1 | tee "$R/ab_wgfwd.log"
    timeout "$(cap 90 0)" $PY scripts/jax_scaling.py 2>&1 | tail -n 5 | tee "$R/jax_scaling.log" ;;
quick)
    timeout "$(cap 60 0)" $PY scripts/ab_kernels.py decode 2>&1 | tee "$R/ab_decode.log"
    timeout "$(cap 40 0)" $PY scripts/ab_kernels.py postbwd 2>&1 | tee "$R/ab_postbwd.log"
    timeout "$(cap 30 0)" $PY scripts/profile_host.py --layer 2>&1 | tee "$R/profile_host.log"
    timeout "$(cap 30 0)" $PY scripts/ab_kernels.py wgfwd 2>&1 | tee "$R/ab_wgfwd.log"
    timeout "$(cap 90 150)" $PY scripts/jax_scaling.py 2>&1 | tail -n 5 | tee "$R/jax_scaling.log"
    l=$(left 5); [ "$l" -gt 30 ] && timeout "$l" $PY -m mhc_cupy.bench --small --out "$R/small" > "$R/small.log" 2>&1
    echo "small rc=$? $((SECONDS - T0)) s"; grep -v "^$" "$R/small/small.md" 2>/dev/null | head -n 40 ;;
*)
    echo "part must be check, small, bench, profile, suite, ncu or quick, got '$PART'" >&2; exit 2 ;;
esac
