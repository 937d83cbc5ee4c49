#!/usr/bin/env bash
# gap.py on main's build (BUILD, default .carry/s54m): where the sync-per-call FP8 sage call's wall
# time goes beyond its kernels' GPU time. One nvidia-h200 call, about 2 minutes.
set -u
export CUDA_PATH=/usr/local/cuda
B=${BUILD:-.carry/s54m}; N=bench/results/h200-2026-12-01-sage-gap
export CUBEATTN_COMMIT=$(cat $B/COMMIT 2>/dev/null || echo unknown)
L=$OUT/logs; mkdir -p $L
PYB=$(mktemp -d)
timeout 60 python3 -m pip install -q --no-deps --target $PYB $B/cubeattn-*.whl > $L/pip.log 2>&1
timeout 20 nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv > $L/gpu.txt 2>&1
PYTHONPATH=$PYB timeout 200 python3 $N/gap.py > $L/gap.txt 2> $L/gap.err
echo "gap rc=$?" >> $L/summary.txt
tar czf $OUT/run.tgz -C $OUT logs
grep '^{' $L/gap.txt; cat $L/summary.txt; tail -5 $L/gap.err
