#!/usr/bin/env bash
# One nvidia-h200 call on the build of branch fix/fp8-odd-tiles (B): dbg2.py (NaN counts by key
# tile count, 6 calls each) under each CUBEATTN_CUDA_FP8_FIX setting (1: every FP8 pair phase with
# two boxes, 2: async-proxy fence after the barriers' init, 4: cube barrier after the pair loop).
set -u
export CUDA_PATH=/usr/local/cuda
B=.carry/s53n; N=bench/results/h200-2026-12-01-fp8-nan
L=$OUT/logs; mkdir -p $L
PYX=$(mktemp -d)
python3 -m pip install -q --no-deps --target $PYX $B/cubeattn-*.whl > $L/pip.log 2>&1
export PYTHONPATH=$PYX CUBEATTN_CACHE_DIR=off
for fix in 0 1 2 4 0 1 2 4; do
  echo "== CUBEATTN_CUDA_FP8_FIX=$fix" >> $L/dbg3.txt
  CUBEATTN_CUDA_FP8_FIX=$fix timeout 60 python3 $N/dbg2.py >> $L/dbg3.txt 2>&1
done
tar czf $OUT/run.tgz -C $OUT logs
cat $L/dbg3.txt
