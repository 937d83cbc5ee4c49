#!/usr/bin/env bash
# The staged epilogue against the direct one (CUBEATTN_FWD_OUT=direct) in alternating processes,
# SDPA cuDNN in each (out_ab.py), build .carry/so.
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
for r in 1 2 3; do
  case $r in 2) order="staged direct" ;; *) order="direct staged" ;; esac
  for o in $order; do
    if [ $o = direct ]; then CUBEATTN_FWD_OUT=direct TMO=150 step ab_${o}_r$r python3 $R/out_ab.py $L/ab_${o}_r$r.json
    else TMO=150 step ab_${o}_r$r python3 $R/out_ab.py $L/ab_${o}_r$r.json; fi
    [ $(el) -gt ${BUDGET:-480} ] && break 2
  done
done
python3 $R/table.py $L/ab_*.json > $L/table.md; pack
cat $L/summary.txt $L/table.md
