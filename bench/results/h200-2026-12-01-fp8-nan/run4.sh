#!/usr/bin/env bash
# One nvidia-h200 call on main's build: dbg4.py (the FP8 call's workspace or output allocated
# filled with 0xFF or zeros).
set -u
export CUDA_PATH=/usr/local/cuda
B=.carry/s52x; N=bench/results/h200-2026-12-01-fp8-nan
L=$OUT/logs; mkdir -p $L
PYX=$(mktemp -d)
python3 -m pip install -q --no-deps --target $PYX $B/cubeattn-*.whl > $L/pip.log 2>&1
export PYTHONPATH=$PYX
timeout 120 python3 $N/dbg4.py > $L/dbg4.txt 2>&1; echo "rc=$?" >> $L/dbg4.txt
tar czf $OUT/run.tgz -C $OUT logs
cat $L/dbg4.txt
