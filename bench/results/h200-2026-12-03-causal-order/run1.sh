#!/usr/bin/env bash
# Causal calls kv head outer? The dense Hopper forward (llama3-8b d128 4K-32K, gqa-d64 8K-32K,
# causal) and one zigzag rank's grouped forward (zigzag_ab.py) with CUBEATTN_FWD_ORDER=heads (the
# causal default) and kv in alternating processes, two rounds, the cuDNN peers in every process.
# Build of main 37c573c (.carry/m61).
set -u
cd "$(dirname "$0")/../../.."
B=.carry/m61; R=bench/results/h200-2026-12-03-causal-order
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} CUBEATTN_REQUIRE_GPU=1
export CUBEATTN_COMMIT=$(cat $B/COMMIT) CUBEATTN_CACHE_DIR=$(mktemp -d)
PYX=$(mktemp -d); timeout 120 python3 -m pip install -q --no-deps --target $PYX $B/cubeattn-*.whl > /dev/null 2>&1
export PYTHONPATH=$PYX
L=$(mktemp -d)/logs; mkdir -p $L
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
pack() { tar -C $(dirname $L) -czf $OUT/logs.tgz logs; }
step() { local n=$1; shift; local s=$(date +%s); timeout ${TMO:-120} "$@" > $L/$n.txt 2>&1; local rc=$?; echo "$n rc=$rc $(( $(date +%s)-s ))s (at $(el) s)" | tee -a $L/summary.txt; pack; }
BENCH="python3 -c 'import sys, cubeattn.bench as b; sys.exit(b.main(sys.argv[1:]))'"
timeout 20 nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv > $L/gpu.txt 2>&1
for r in 1 2; do
  case $r in 2) order="kv heads" ;; *) order="heads kv" ;; esac
  for o in $order; do
    CUBEATTN_FWD_ORDER=$o TMO=100 step d128_${o}_r$r bash -c "$BENCH dense --config llama3-8b --seqlens 4096 8192 16384 32768 --json $L/d128_${o}_r$r.json"
    CUBEATTN_FWD_ORDER=$o TMO=70 step d64_${o}_r$r bash -c "$BENCH dense --config gqa-d64 --seqlens 8192 16384 32768 --json $L/d64_${o}_r$r.json"
    CUBEATTN_FWD_ORDER=$o TMO=70 step zz_${o}_r$r python3 $R/zigzag_ab.py $L/zz_${o}_r$r.json
  done
done
pack
cat $L/summary.txt
python3 $R/table.py $L/d*_r*.json
python3 $R/table.py $L/zz_*.json
