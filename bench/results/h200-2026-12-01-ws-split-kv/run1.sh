#!/usr/bin/env bash
# Prepared for the next GPU call (not yet run): branch exp/fwd-kv-producers, one build (BUILD_DIR:
# wheel + gpu_main + COMMIT). A/B of CUBEATTN_CUDA_WS_SPLIT_KV=1 (K and V tiles by two producer
# threads) against the default in alternating processes with SDPA cuDNN in each, then the Rust
# forward suite (its ws-split-kv option set), pytest test_gpu with the switch on, and two sanitizers
# on a multi-tile launch with it. One nvidia-h200 call, about 6 minutes.
set -u
export CUDA_PATH=/usr/local/cuda
B=.carry/s53k; P=bench/results/h200-2026-12-01-persistent
export CUBEATTN_COMMIT=$(cat $B/COMMIT 2>/dev/null || echo unknown)
L=$OUT/logs; mkdir -p $L
python3 -m pip install -q --no-deps --target /tmp/pyx $B/cubeattn-*.whl > $L/pip.log 2>&1
export PYTHONPATH=/tmp/pyx
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
pack() { python3 $P/table.py $L/ab_*.jsonl > $L/table.md 2>/dev/null; tar czf $OUT/run.tgz -C $OUT logs; }
for r in 1 2 3; do
  order="0 1"; [ $r = 2 ] && order="1 0"
  for sp in $order; do
    CUBEATTN_CUDA_WS_SPLIT_KV=$sp timeout 60 python3 $P/ab_fwd.py split$sp --cudnn > $L/ab_split${sp}_$r.jsonl 2>$L/ab_split${sp}_$r.err
  done
  echo "round $r ($(el) s)" >> $L/summary.txt
done
pack
timeout 240 $B/gpu_main --include-ignored --test-threads 1 --nocapture gpu::flash_attention::forward_matches > $L/rust_fwd.log 2>&1
echo "rust forward rc=$? ($(el) s)" >> $L/summary.txt
grep -E "FAIL|panicked|test result|ERROR| NO$" $L/rust_fwd.log | head -30 >> $L/summary.txt
pack
CUBEATTN_CUDA_WS_SPLIT_KV=1 timeout 100 python3 -m pytest -q -x -m "gpu or torch" tests/python/test_gpu.py -p no:cacheprovider > $L/pytest.log 2>&1
echo "pytest (split) rc=$? ($(el) s): $(tail -1 $L/pytest.log)" >> $L/summary.txt
pack
for tool in synccheck memcheck; do
  CUBEATTN_CUDA_WS_SPLIT_KV=1 timeout 60 compute-sanitizer --tool $tool --error-exitcode 9 python3 $P/san_fwd.py > $L/san_$tool.log 2>&1
  echo "$tool rc=$? ($(el) s): $(grep -E 'ERROR SUMMARY|rel_l2' $L/san_$tool.log | tr '\n' ' ')" >> $L/summary.txt
  pack
done
cat $L/summary.txt $L/table.md
