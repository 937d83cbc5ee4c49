#!/usr/bin/env bash
# The second call (nvidia-h200) on the build with 160-key tiles as the default (BUILD_DIR): the A/B
# of CUBEATTN_CUDA_WS_BN=128 against the default in alternating processes with SDPA cuDNN in each,
# `bench dense --no-causal` (d128, torch calls in turns), the Rust forward suite (its case table
# printed), pytest test_gpu and memcheck on a 160-key launch.
set -u
export CUDA_PATH=/usr/local/cuda
B=BUILD_DIR; P=bench/results/h200-2026-12-01-persistent
L=$OUT/logs; mkdir -p $L
python3 -m pip install -q --no-deps --target /tmp/pyx $B/cubeattn-*.whl > $L/pip.log 2>&1
export PYTHONPATH=/tmp/pyx
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
pack() { python3 $P/table.py $L/ab_*.jsonl > $L/table.md 2>/dev/null; tar czf $OUT/run.tgz -C $OUT logs; }
for r in 1 2 3; do
  order="128 160"; [ $r = 2 ] && order="160 128"
  for bn in $order; do
    CUBEATTN_CUDA_WS_BN=$bn timeout 60 python3 $P/ab_fwd.py bn$bn --cudnn > $L/ab_bn${bn}_$r.jsonl 2>$L/ab_bn${bn}_$r.err
  done
  echo "round $r ($(el) s)" >> $L/summary.txt
done
pack
timeout 90 python3 -m cubeattn.bench dense --device cuda --config llama3-8b --no-causal --iterations 20 --json $L/dense_nc.json > $L/dense_nc.txt 2>&1
echo "dense rc=$? ($(el) s)" >> $L/summary.txt; pack
timeout 100 python3 -m pytest -q -x -m "gpu or torch" tests/python/test_gpu.py -p no:cacheprovider > $L/pytest.log 2>&1
echo "pytest rc=$? ($(el) s): $(tail -1 $L/pytest.log)" >> $L/summary.txt
pack
timeout 240 $B/gpu_main --include-ignored --test-threads 1 --nocapture gpu::flash_attention::forward_matches gpu::nonfinite:: > $L/rust_fwd.log 2>&1
echo "rust forward rc=$? ($(el) s)" >> $L/summary.txt
grep -E "FAIL|panicked|test result|ERROR| NO$" $L/rust_fwd.log | head -30 >> $L/summary.txt
grep -E "noncausal" $L/rust_fwd.log | head -40 >> $L/summary.txt
pack
timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 python3 $P/san_fwd.py > $L/san_memcheck.log 2>&1
echo "memcheck rc=$? ($(el) s): $(grep -E 'ERROR SUMMARY|rel_l2' $L/san_memcheck.log | tr '\n' ' ')" >> $L/summary.txt
pack
cat $L/summary.txt $L/table.md; grep -v "^#" $L/dense_nc.txt
