#!/usr/bin/env bash
# One nvidia-h200 call on the build of exp/fwd-kv-outer (.carry/kvo): (a) `bench dense` non-causal,
# llama3-8b (32 / 8 heads d128, 4K-32K) and gqa-d64 (8K, 16K), with CUBEATTN_FWD_ORDER=heads
# (main's order) and the default (kv head outer) in alternating processes, two rounds, SDPA cuDNN /
# flash in every process; (b) ncu memory sections of our d128 forward at 8K / 16K in both orders;
# (c) the Rust forward f64 suite (variants default, no-split, no-ws) and the value-dim forward test.
set -u
cd "$(dirname "$0")/../../.."
B=.carry/kvo; R=bench/results/h200-2026-12-03-fwd-order
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} CUBEATTN_REQUIRE_GPU=1
export CUBEATTN_COMMIT=$(cat $B/COMMIT 2>/dev/null || echo unknown)
export CUBEATTN_CACHE_DIR=$(mktemp -d)
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
    CUBEATTN_FWD_ORDER=$o TMO=90 step d128_${o}_r$r bash -c "$BENCH dense --config llama3-8b --no-causal --seqlens 4096 8192 16384 32768 --json $L/d128_${o}_r$r.json"
    CUBEATTN_FWD_ORDER=$o TMO=60 step d64_${o}_r$r bash -c "$BENCH dense --config gqa-d64 --no-causal --seqlens 8192 16384 --json $L/d64_${o}_r$r.json"
  done
done
for o in heads kv; do
  for S in 8192 16384; do
    CUBEATTN_FWD_ORDER=$o IMPL=ours S=$S TMO=60 step ncu_${o}_$S ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis -k regex:flash_fwd_ws --launch-skip 2 --launch-count 1 python3 $R/fwd_step.py
  done
done
CUBEATTN_GPU_VARIANTS=default,no-split,no-ws TMO=200 step rust_fwd $B/gpu_main --include-ignored --test-threads 1 --nocapture forward_matches_f64_reference
TMO=80 step rust_vdim $B/gpu_main --include-ignored --test-threads 1 --nocapture value_head_dim_of_its_own_matches_f64_reference
pack
cat $L/summary.txt
grep -hE "test result|FAIL|panicked" $L/rust_*.txt | head
for f in $L/ncu_*.txt; do echo "== $(basename $f)"; grep -E "Duration|L2 Hit Rate|DRAM Throughput|Elapsed Cycles" $f | head -5; done
python3 $R/table.py $L/d*_r*.json
