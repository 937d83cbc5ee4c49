#!/usr/bin/env bash
# One nvidia-h200 call on main's build: dbg6.py (the parts an FP8 call writes into its
# zero-filled workspace).
set -u
export CUDA_PATH=/usr/local/cuda
B=.carry/s52x; N=bench/results/h200-2026-12-01-fp8-nan
L=$OUT/logs; mkdir -p $L
PYX=$(mktemp -d)
python3 -m pip install -q --no-deps --target $PYX $B/cubeattn-*.whl > $L/pip.log 2>&1
export PYTHONPATH=$PYX
timeout 150 python3 $N/dbg6.py > $L/dbg6.txt 2>&1; echo "rc=$?" >> $L/dbg6.txt
tar czf $OUT/run.tgz -C $OUT logs
cat $L/dbg6.txt
