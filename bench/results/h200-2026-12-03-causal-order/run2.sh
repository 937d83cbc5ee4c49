#!/usr/bin/env bash
# Second call, on the build with the new rule (.carry/co: causal calls on the warp-specialised
# frame kv head outer): `bench dense` causal d128 4K-32K and d192 / d256 8K-16K with the default
# and CUBEATTN_FWD_ORDER=heads in alternating processes (two rounds, SDPA cuDNN / flash in every
# process); the Rust f64 forward suite (default, no-split, no-ws), pytest's grouped / zigzag /
# window files.
set -u
cd "$(dirname "$0")/../../.."
B=.carry/co; R=bench/results/h200-2026-12-03-causal-order
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} CUBEATTN_REQUIRE_GPU=1
export CUBEATTN_COMMIT=$(cat $B/COMMIT) CUBEATTN_CACHE_DIR=$(mktemp -d)
PYX=$(mktemp -d); timeout 120 python3 -m pip install -q --no-deps --target $PYX $B/cubeattn-*.whl > /dev/null 2>&1
export PYTHONPATH=$PYX
L=$(mktemp -d)/logs; mkdir -p $L
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
pack() { tar -C $(dirname $L) -czf $OUT/logs.tgz logs; }
step() { local n=$1; shift; local s=$(date +%s); timeout ${TMO:-120} "$@" > $L/$n.txt 2>&1; local rc=$?; echo "$n rc=$rc $(( $(date +%s)-s ))s (at $(el) s)" | tee -a $L/summary.txt; pack; }
BENCH="python3 -c 'import sys, cubeattn.bench as b; sys.exit(b.main(sys.argv[1:]))'"
for r in 1 2; do
  case $r in 2) order="heads kv" ;; *) order="kv heads" ;; esac
  for o in $order; do
    if [ $o = heads ]; then export CUBEATTN_FWD_ORDER=heads; else unset CUBEATTN_FWD_ORDER; fi
    TMO=100 step d128_${o}_r$r bash -c "$BENCH dense --config llama3-8b --seqlens 4096 8192 16384 32768 --json $L/d128_${o}_r$r.json"
    TMO=60 step d256_${o}_r$r bash -c "$BENCH dense --config gqa-d256 --seqlens 8192 16384 --json $L/d256_${o}_r$r.json"
    TMO=60 step d192_${o}_r$r bash -c "$BENCH dense --config gqa-d192 --seqlens 8192 16384 --json $L/d192_${o}_r$r.json"
  done
done
unset CUBEATTN_FWD_ORDER
CUBEATTN_GPU_VARIANTS=default,no-split,no-ws TMO=130 step rust_fwd $B/gpu_main --include-ignored --test-threads 1 --nocapture forward_matches_f64_reference
T=tests/python
TMO=60 step pytest_zigzag python3 -m pytest -q -rf -m "gpu or torch" -p no:cacheprovider $T/test_zigzag_gpu.py -k "in_place_read or more_cubes"
TMO=$(( 420 - $(el) )) step pytest_window python3 -m pytest -q -rf -x -m "gpu or torch" -p no:cacheprovider $T/test_window_gpu.py $T/test_gpu.py
pack
cat $L/summary.txt
grep -hE "test result|FAIL|panicked|passed|failed" $L/rust_*.txt $L/pytest_*.txt | head
python3 $R/table.py $L/d*_r*.json
