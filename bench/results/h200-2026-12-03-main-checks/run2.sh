#!/usr/bin/env bash
# Second call: the pytest files of run1.sh again, without -x, test_gpu.py's fallback test now at
# head_dim 264 (every head_dim up to 256 runs on CUDA since 2026-12-02; run1 stopped at it). Build
# of aa7711c (.carry/dqo).
set -u
cd "$(dirname "$0")/../../.."
B=.carry/dqo
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} CUBEATTN_REQUIRE_GPU=1
export CUBEATTN_COMMIT=$(cat $B/COMMIT) CUBEATTN_CACHE_DIR=$(mktemp -d)
PYX=$(mktemp -d); timeout 120 python3 -m pip install -q --no-deps --target $PYX $B/cubeattn-*.whl > /dev/null 2>&1
export PYTHONPATH=$PYX
L=$(mktemp -d)/logs; mkdir -p $L
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
pack() { tar -C $(dirname $L) -czf $OUT/logs.tgz logs; }
step() { local n=$1; shift; local s=$(date +%s); timeout ${TMO:-120} "$@" > $L/$n.txt 2>&1; local rc=$?; echo "$n rc=$rc $(( $(date +%s)-s ))s (at $(el) s): $(tail -1 $L/$n.txt | cut -c1-150)" | tee -a $L/summary.txt; pack; }
T=tests/python
TMO=420 step pytest_core python3 -m pytest -q -m "gpu or torch" -p no:cacheprovider $T/test_gpu.py $T/test_torch.py $T/test_window_gpu.py $T/test_zigzag_gpu.py $T/test_kvcache_gpu.py $T/test_decode_gpu.py $T/test_nonfinite.py $T/test_sparse_gpu.py $T/test_compile_gpu.py
CS=$(command -v compute-sanitizer || echo $CUDA_PATH/bin/compute-sanitizer)
for fam in ; do
  for tool in memcheck synccheck; do
    [ $(el) -gt 520 ] && break 2
    TMO=60 step ${tool}_$fam $CS --tool $tool --error-exitcode 99 python3 $T/sanitize_driver.py $fam
  done
done
pack
cat $L/summary.txt
grep -E "passed|failed" $L/pytest_core.txt | tail -3
