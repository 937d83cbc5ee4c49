#!/usr/bin/env bash
# Correctness of the staged epilogue (build .carry/so, branch fwd-staged-out): pytest test_gpu /
# test_nonfinite, the Rust f64 forward suite with the non-finite family, memcheck and racecheck of
# the forward, window, head_dims and nonfinite families.
set -u
cd "$(dirname "$0")/../../.."
B=.carry/so; R=bench/results/h200-2026-12-03-staged-out
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} CUBEATTN_REQUIRE_GPU=1
export CUBEATTN_COMMIT=$(cat $B/COMMIT) CUBEATTN_CACHE_DIR=$(mktemp -d)
PYX=$(mktemp -d); timeout 120 python3 -m pip install -q --no-deps --target $PYX $B/cubeattn-*.whl > /dev/null 2>&1
export PYTHONPATH=$PYX
L=$(mktemp -d)/logs; mkdir -p $L
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
pack() { tar -C $(dirname $L) -czf $OUT/logs.tgz logs; }
step() { local n=$1; shift; local s=$(date +%s); timeout ${TMO:-120} "$@" > $L/$n.txt 2>&1; local rc=$?; echo "$n rc=$rc $(( $(date +%s)-s ))s (at $(el) s)" | tee -a $L/summary.txt; pack; }
timeout 20 nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv > $L/gpu.txt 2>&1
T=tests/python
TMO=110 step pytest_gpu python3 -m pytest -q -rf --tb=short -m "gpu or torch" -p no:cacheprovider $T/test_gpu.py
TMO=60 step pytest_nonfinite python3 -m pytest -q -rf --tb=short -p no:cacheprovider $T/test_nonfinite.py
TMO=200 step rust_fwd $B/gpu_main --include-ignored --test-threads 1 gpu::flash_attention::forward_matches gpu::nonfinite::
export CUBEATTN_WHEEL=$(ls $B/cubeattn-*.whl)
CUBEATTN_SAN_TOOLS="memcheck racecheck" CUBEATTN_SAN_FAMILIES="forward window head_dims nonfinite" TMO=170 step sanitize scripts/gpu-test.sh sanitize
pack
cat $L/summary.txt
grep -hE "passed|failed|FAILED|^E " $L/pytest_*.txt | tail -8 | cut -c1-200
grep -hE "test result|FAIL|panicked" $L/rust_fwd.txt | head -12 | cut -c1-200
grep -E "exit" $L/sanitize.txt
