#!/usr/bin/env bash
# One nvidia-h200 call, two builds: A = .carry/kvo (949fbea: the dQ pass's cubes heads fastest),
# B = .carry/dqo (exp/dq-kv-outer: kv head outer for dense non-causal calls). (a) B's Rust backward
# f64 suite (both dQ paths, determinism); (b) `bench fwdbwd --no-causal --dense-only`, llama3-8b 8K /
# 16K and gqa-d256 8K (whose default path runs the dQ pass), A and B in alternating processes, two
# rounds, SDPA cuDNN / flash in every process.
set -u
cd "$(dirname "$0")/../../.."
R=bench/results/h200-2026-12-03-dq-order
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} CUBEATTN_REQUIRE_GPU=1
export CUBEATTN_CACHE_DIR=$(mktemp -d)
declare -A PY CM
for x in A B; do
  d=$([ $x = A ] && echo .carry/kvo || echo .carry/dqo)
  PY[$x]=$(mktemp -d); timeout 120 python3 -m pip install -q --no-deps --target ${PY[$x]} $d/cubeattn-*.whl > /dev/null 2>&1
  CM[$x]=$(cat $d/COMMIT)
done
L=$(mktemp -d)/logs; mkdir -p $L
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
pack() { tar -C $(dirname $L) -czf $OUT/logs.tgz logs; }
step() { local n=$1; shift; local s=$(date +%s); timeout ${TMO:-120} "$@" > $L/$n.txt 2>&1; local rc=$?; echo "$n rc=$rc $(( $(date +%s)-s ))s (at $(el) s)" | tee -a $L/summary.txt; pack; }
BENCH="python3 -c 'import sys, cubeattn.bench as b; sys.exit(b.main(sys.argv[1:]))'"
timeout 20 nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv > $L/gpu.txt 2>&1
TMO=150 step rust_bwd_B .carry/dqo/gpu_main --include-ignored --test-threads 1 --nocapture backward_matches_f64_reference
for r in 1 2; do
  case $r in 2) order="B A" ;; *) order="A B" ;; esac
  for x in $order; do
    PYTHONPATH=${PY[$x]} CUBEATTN_COMMIT=${CM[$x]} TMO=90 step d128_${x}_r$r bash -c "$BENCH fwdbwd --config llama3-8b --no-causal --dense-only --seqlens 8192 16384 --json $L/d128_${x}_r$r.json"
    PYTHONPATH=${PY[$x]} CUBEATTN_COMMIT=${CM[$x]} TMO=60 step d256_${x}_r$r bash -c "$BENCH fwdbwd --config gqa-d256 --no-causal --dense-only --seqlens 8192 --json $L/d256_${x}_r$r.json"
  done
done
pack
cat $L/summary.txt
grep -hE "test result|FAIL|panicked" $L/rust_*.txt | head
python3 $R/table.py $L/d*_r*.json
