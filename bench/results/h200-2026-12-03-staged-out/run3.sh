#!/usr/bin/env bash
# The final commit's build (.carry/fin, the A/B switch removed): pytest test_gpu, then issue 40's
# `bench dense` rows (d128 / d64, causal and not, 4K-32K) and `bench fwdbwd --dense-only` at d128.
set -u
cd "$(dirname "$0")/../../.."
B=.carry/fin; R=bench/results/h200-2026-12-03-staged-out
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} CUBEATTN_REQUIRE_GPU=1
export CUBEATTN_COMMIT=$(cat $B/COMMIT) CUBEATTN_CACHE_DIR=$(mktemp -d)
PYX=$(mktemp -d); timeout 120 python3 -m pip install -q --no-deps --target $PYX $B/cubeattn-*.whl > /dev/null 2>&1
export PYTHONPATH=$PYX
L=$(mktemp -d)/logs; mkdir -p $L
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
pack() { tar -C $(dirname $L) -czf $OUT/logs.tgz logs; }
step() { local n=$1; shift; local s=$(date +%s); timeout ${TMO:-120} "$@" > $L/$n.txt 2>&1; local rc=$?; echo "$n rc=$rc $(( $(date +%s)-s ))s (at $(el) s)" | tee -a $L/summary.txt; pack; }
timeout 20 nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv > $L/gpu.txt 2>&1
TMO=110 step pytest_gpu python3 -m pytest -q -rf --tb=short -m "gpu or torch" -p no:cacheprovider tests/python/test_gpu.py
BENCH="python3 -c 'import sys, cubeattn.bench as b; sys.exit(b.main(sys.argv[1:]))'"
for c in llama3-8b gqa-d64; do
  for m in --causal --no-causal; do
    TMO=100 step dense_${c}${m} bash -c "$BENCH dense --config $c $m --seqlens 4096 8192 16384 32768 --json $L/dense_${c}${m}.json"
  done
done
for m in --causal --no-causal; do
  TMO=150 step fwdbwd_llama3-8b${m} bash -c "$BENCH fwdbwd --config llama3-8b $m --dense-only --seqlens 4096 8192 16384 32768 --json $L/fwdbwd_llama3-8b${m}.json"
done
pack
cat $L/summary.txt
grep -hE "passed|failed" $L/pytest_gpu.txt | tail -2
grep -h "dense_fwd" $L/dense_*.txt | grep -v "^what"
grep -h "dense_fwdbwd" $L/fwdbwd_*.txt | grep -v "^what"
