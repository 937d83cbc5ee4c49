#!/usr/bin/env bash
# Branch exp/fp8-empty-barriers (build E) against main (build M): the FP8 P.V pair loop of
# flash_fwd_sm90 reuses a stage once both warpgroups released it on an mbarrier, instead of a cube
# barrier per pair. (a) on E: the Rust INT8 / FP8 GPU suites (`int8`), pytest test_sage.py and
# test_sparse_fp8.py; (b) the sage A/B in alternating processes (M E E M M E) with
# ../h200-2026-12-01-sage-poly/ab_sage.py, whose `poly` label here carries the build (0 = M,
# 1 = E); (c) compute-sanitizer synccheck and racecheck of san_fp8.py on E. One nvidia-h200 call.
set -u
export CUDA_PATH=/usr/local/cuda
E=${E:-.carry/s54e}; M=${M:-.carry/s54m}; P=bench/results/h200-2026-12-01-sage-poly
L=$OUT/logs; mkdir -p $L
PYE=$(mktemp -d); PYM=$(mktemp -d)
timeout 60 python3 -m pip install -q --no-deps --target $PYE $E/cubeattn-*.whl > $L/pip.log 2>&1
timeout 60 python3 -m pip install -q --no-deps --target $PYM $M/cubeattn-*.whl >> $L/pip.log 2>&1
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
pack() { python3 $P/table.py $L/ab_*.jsonl > $L/table.md 2>/dev/null; tar czf $OUT/run.tgz -C $OUT logs; }
timeout 20 nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv > $L/gpu.txt 2>&1
# (a)
timeout 150 $E/gpu_main --include-ignored --test-threads 1 --nocapture int8 > $L/rust_int8.log 2>&1
echo "(a) rust int8 rc=$? ($(el) s): $(grep 'test result' $L/rust_int8.log | tr '\n' ' ')" >> $L/summary.txt
grep -E "FAIL|panicked" $L/rust_int8.log | head -10 >> $L/summary.txt
PYTHONPATH=$PYE timeout 100 python3 -m pytest -q -m "gpu or torch" tests/python/test_sage.py tests/python/test_sparse_fp8.py -p no:cacheprovider -rf > $L/pytest.log 2>&1
echo "(a) pytest sage + sparse_fp8 rc=$? ($(el) s): $(tail -1 $L/pytest.log)" >> $L/summary.txt; pack
# (b)
r=0
for b in M E E M M E; do
  r=$((r + 1)); py=$PYE; p=1; [ $b = M ] && py=$PYM && p=0
  if [ $(el) -gt 430 ]; then echo "(b) run $r ($b) skipped ($(el) s)" >> $L/summary.txt; continue; fi
  PYTHONPATH=$py CUBEATTN_CUDA_SAGE_POLY=$p timeout 75 python3 $P/ab_sage.py $b > $L/ab_${b}_$r.jsonl 2> $L/ab_${b}_$r.err
  echo "(b) ab $b run $r rc=$? ($(el) s)" >> $L/summary.txt; pack
done
# (c)
for tool in synccheck racecheck; do
  if [ $(el) -gt 520 ]; then echo "(c) $tool skipped ($(el) s)" >> $L/summary.txt; continue; fi
  PYTHONPATH=$PYE timeout 70 compute-sanitizer --tool $tool --error-exitcode 9 python3 $P/san_fp8.py > $L/san_$tool.log 2>&1
  echo "(c) $tool rc=$? ($(el) s): $(grep -E 'SUMMARY|worst' $L/san_$tool.log | tr '\n' ' ')" >> $L/summary.txt; pack
done
cat $L/summary.txt $L/table.md
