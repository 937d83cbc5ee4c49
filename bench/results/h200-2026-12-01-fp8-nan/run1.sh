#!/usr/bin/env bash
# One nvidia-h200 call on main's build (B: kernels of 965ca7c, which main 60d4c66 generates
# unchanged): dbg_fp8.py, then the FP8 pytest case that found the NaN (test_sage.py of branch
# exp/sage-poly-exp2) with the polynomial off.
set -u
export CUDA_PATH=/usr/local/cuda
B=.carry/s52x; N=bench/results/h200-2026-12-01-fp8-nan
L=$OUT/logs; mkdir -p $L
PYX=$(mktemp -d)
python3 -m pip install -q --no-deps --target $PYX $B/cubeattn-*.whl > $L/pip.log 2>&1
export PYTHONPATH=$PYX
timeout 150 python3 $N/dbg_fp8.py > $L/dbg_fp8.txt 2>&1; echo "dbg rc=$?" >> $L/summary.txt
timeout 60 python3 -m pytest -q -x -m "gpu or torch" tests/python/test_sage.py -k fp8_pv -p no:cacheprovider > $L/pytest.log 2>&1
echo "pytest rc=$?: $(tail -1 $L/pytest.log)" >> $L/summary.txt
tar czf $OUT/run.tgz -C $OUT logs
cat $L/summary.txt $L/dbg_fp8.txt
