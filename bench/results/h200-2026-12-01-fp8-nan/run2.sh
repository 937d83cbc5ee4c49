#!/usr/bin/env bash
# One nvidia-h200 call on main's build: NaN frequency by tile count (dbg2.py), then
# compute-sanitizer initcheck and racecheck of one FP8 call with 9 key tiles.
set -u
export CUDA_PATH=/usr/local/cuda
B=.carry/s52x; N=bench/results/h200-2026-12-01-fp8-nan
L=$OUT/logs; mkdir -p $L
PYX=$(mktemp -d)
python3 -m pip install -q --no-deps --target $PYX $B/cubeattn-*.whl > $L/pip.log 2>&1
export PYTHONPATH=$PYX
timeout 60 python3 $N/dbg2.py > $L/dbg2.txt 2>&1; echo "dbg2 rc=$?" >> $L/summary.txt
for tool in initcheck racecheck; do
  timeout 90 compute-sanitizer --tool $tool --print-limit 20 python3 $N/dbg2.py one > $L/san_$tool.txt 2>&1
  echo "$tool rc=$?: $(grep -E 'ERROR SUMMARY|nonfinite' $L/san_$tool.txt | tr '\n' ' ')" >> $L/summary.txt
done
tar czf $OUT/run.tgz -C $OUT logs
cat $L/summary.txt $L/dbg2.txt; grep -E -m12 "Uninitialized|Race|at 0x|by thread|in " $L/san_initcheck.txt
