#!/usr/bin/env bash
# One nvidia-h200 call on the build of branch exp/fwd-wide (BUILD_DIR: wheel + gpu_main): the A/B of
# flash_fwd_ws's key tile at d128 (CUBEATTN_CUDA_WS_BN = 128, 144, 160, 176) in alternating
# processes with SDPA cuDNN in each, then pytest test_gpu, the Rust forward suite and two sanitizers
# on a 176-key launch; logs tarred after each stage.
set -u
export CUDA_PATH=/usr/local/cuda
B=BUILD_DIR; P=bench/results/h200-2026-12-01-persistent
L=$OUT/logs; mkdir -p $L
python3 -m pip install -q --no-deps --target /tmp/pyx $B/cubeattn-*.whl > $L/pip.log 2>&1
export PYTHONPATH=/tmp/pyx
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
pack() { python3 $P/table.py $L/ab_*.jsonl > $L/table.md 2>/dev/null; tar czf $OUT/run.tgz -C $OUT logs; }
for r in 1 2; do
  order="128 176 160 144"; [ $r = 2 ] && order="144 160 176 128"
  for bn in $order; do
    CUBEATTN_CUDA_WS_BN=$bn timeout 60 python3 $P/ab_fwd.py bn$bn --cudnn > $L/ab_bn${bn}_$r.jsonl 2>$L/ab_bn${bn}_$r.err
  done
  echo "round $r ($(el) s)" >> $L/summary.txt
done
pack
timeout 100 python3 -m pytest -q -x -m "gpu or torch" tests/python/test_gpu.py -p no:cacheprovider > $L/pytest.log 2>&1
echo "pytest rc=$? ($(el) s): $(tail -1 $L/pytest.log)" >> $L/summary.txt
pack
timeout 240 $B/gpu_main --include-ignored --test-threads 1 gpu::flash_attention::forward_matches gpu::sparse::sparse_forward gpu::nonfinite:: > $L/rust_fwd.log 2>&1
echo "rust forward rc=$? ($(el) s)" >> $L/summary.txt
grep -E "FAIL|panicked|test result|ERROR| NO$" $L/rust_fwd.log | head -30 >> $L/summary.txt
pack
for tool in synccheck memcheck; do
  timeout 60 compute-sanitizer --tool $tool --error-exitcode 9 python3 $P/san_fwd.py > $L/san_$tool.log 2>&1
  echo "$tool rc=$? ($(el) s): $(grep -E 'ERROR SUMMARY|rel_l2' $L/san_$tool.log | tr '\n' ' ')" >> $L/summary.txt
  pack
done
cat $L/summary.txt $L/table.md
