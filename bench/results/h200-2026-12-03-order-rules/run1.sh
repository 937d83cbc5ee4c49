#!/usr/bin/env bash
# The two child-process GPU test files not yet run on a GPU (test_cube_order_gpu.py,
# test_portable_gpu.py after its child moved to child_case.py), then the cube-order A/B of
# order_ab.py: CUBEATTN_FWD_ORDER=heads / kv in alternating processes, two rounds.
# Build of main 094a13a (.carry/s62).
set -u
cd "$(dirname "$0")/../../.."
B=.carry/s62; R=bench/results/h200-2026-12-03-order-rules
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
TMO=170 step cube_order python3 -m pytest -v -rf --tb=short -m "gpu or torch" -p no:cacheprovider $T/test_cube_order_gpu.py
TMO=120 step portable python3 -m pytest -v -rf --tb=short -m "gpu or torch" -p no:cacheprovider $T/test_portable_gpu.py
grep -hE "passed|failed|FAILED|^E " $L/cube_order.txt $L/portable.txt | tail -12 | cut -c1-200
for r in 1 2; do
  case $r in 2) order="kv heads" ;; *) order="heads kv" ;; esac
  for o in $order; do CUBEATTN_FWD_ORDER=$o TMO=90 step ab_${o}_r$r python3 $R/order_ab.py $L/ab_${o}_r$r.json; done
done
pack
cat $L/summary.txt
python3 $R/table.py $L/ab_*.json
