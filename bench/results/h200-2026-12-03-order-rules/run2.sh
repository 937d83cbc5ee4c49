#!/usr/bin/env bash
# Build of ed39011 (.carry/s62b): the new forward order rules (window calls on the warp-specialised
# frame and d64 causal calls of 256+ items a head slot kv head outer) and CUBEATTN_DQ_ORDER.
# 1. test_cube_order_gpu.py (now with window cases) and test_window_gpu.py;
# 2. the deterministic step with the dQ pass kv head outer / heads fastest (det_ab.py,
#    CUBEATTN_DQ_ORDER alternating, two rounds);
# 3. window calls' fwd+bwd kernels in both backward orders (bwd_window_ab.py, two rounds);
# 4. order_ab.py once in the default order: its times must follow run1's kv rows where the rules
#    changed.
set -u
cd "$(dirname "$0")/../../.."
B=.carry/s62b; R=bench/results/h200-2026-12-03-order-rules
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
TMO=130 step cube_order python3 -m pytest -v -rf --tb=short -m "gpu or torch" -p no:cacheprovider $T/test_cube_order_gpu.py
TMO=100 step window python3 -m pytest -v -rf --tb=short -m "gpu or torch" -p no:cacheprovider $T/test_window_gpu.py
grep -hE "passed|failed|FAILED|^E " $L/cube_order.txt $L/window.txt | tail -12 | cut -c1-200
for r in 1 2; do
  case $r in 2) order="kv heads" ;; *) order="heads kv" ;; esac
  for o in $order; do CUBEATTN_DQ_ORDER=$o TMO=80 step det_${o}_r$r python3 $R/det_ab.py $L/det_${o}_r$r.json; done
done
for r in 1 2; do
  case $r in 2) order="kv heads" ;; *) order="heads kv" ;; esac
  for o in $order; do CUBEATTN_BWD_ORDER=$o CUBEATTN_DQ_ORDER=$o TMO=40 step bw_${o}_r$r python3 $R/bwd_window_ab.py $L/bw_${o}_r$r.json; done
done
TMO=40 step ab_default python3 $R/order_ab.py $L/ab_default.json
pack
cat $L/summary.txt
python3 $R/det_table.py $L/det_*.json
grep -h " kv \| heads " $L/bw_*.txt
cat $L/ab_default.txt
