#!/usr/bin/env bash
# run5.sh reordered for one 600 s call: the A/B first, then pytest, the Rust forward suite and the
# sanitizers (racecheck last), the logs tarred after each stage. NEW / BASE: the two builds'
# folders (wheel + gpu_main each).
set -u
export CUDA_PATH=/usr/local/cuda
NEW=BUILD_DIR; BASE=BUILD_DIR; N=bench/results/h200-2026-12-01-persistent
L=$OUT/logs; mkdir -p $L
python3 -m pip install -q --no-deps --target /tmp/pyx_new $NEW/cubeattn-*.whl > $L/pip.log 2>&1
python3 -m pip install -q --no-deps --target /tmp/pyx_base $BASE/cubeattn-*.whl >> $L/pip.log 2>&1
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
pack() { python3 $N/table.py $L/ab_*.jsonl > $L/table.md 2>/dev/null; tar czf $OUT/run.tgz -C $OUT logs; }
for r in 1 2; do
  PYTHONPATH=/tmp/pyx_base timeout 60 python3 $N/ab_fwd.py main $([ $r = 1 ] && echo --cudnn) > $L/ab_main_$r.jsonl 2>$L/ab_main_$r.err
  PYTHONPATH=/tmp/pyx_new timeout 60 python3 $N/ab_fwd.py loaders $([ $r = 2 ] && echo --cudnn) > $L/ab_loaders_$r.jsonl 2>$L/ab_loaders_$r.err
  echo "round $r ($(el) s)" >> $L/summary.txt
done
pack
PYTHONPATH=/tmp/pyx_new timeout 100 python3 -m pytest -q -x -m "gpu or torch" tests/python/test_gpu.py tests/python/test_sage.py -p no:cacheprovider > $L/pytest.log 2>&1
echo "pytest rc=$? ($(el) s): $(tail -1 $L/pytest.log)" >> $L/summary.txt
pack
timeout 220 $NEW/gpu_main --include-ignored --test-threads 1 gpu::flash_attention::forward_matches gpu::flash_attention::repeated gpu::sparse::sparse_forward gpu::sparse::sparse_int8 gpu::nonfinite:: > $L/rust_fwd.log 2>&1
echo "rust forward rc=$? ($(el) s)" >> $L/summary.txt
grep -E "persistent|FAIL|panicked|test result|ERROR| NO$" $L/rust_fwd.log | head -30 >> $L/summary.txt
pack
for tool in synccheck memcheck racecheck; do
  PYTHONPATH=/tmp/pyx_new timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 python3 $N/san_fwd.py > $L/san_$tool.log 2>&1
  echo "$tool rc=$? ($(el) s): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|rel_l2' $L/san_$tool.log | tr '\n' ' ')" >> $L/summary.txt
  pack
done
cat $L/summary.txt $L/table.md
