#!/usr/bin/env bash
# session 51, call 4 (one H200): `flash_fwd_ws` persistent where the work items cost the same:
# correctness (Rust f64 forward suite with two multi-item cases, sparse forward, nonfinite; pytest
# test_gpu / test_torch; racecheck / synccheck / memcheck of a multi-item launch), then the
# forward A/B in one build, CUBEATTN_CUDA_PERSISTENT=0 (off) against the default (on), alternating
set -u
export CUDA_PATH=/usr/local/cuda
B=BUILD_DIR; N=bench/results/h200-2026-12-01-persistent
L=$OUT/logs; mkdir -p $L
python3 -m pip install -q --no-deps --target /tmp/pyx $B/cubeattn-*.whl > $L/pip.log 2>&1
export PYTHONPATH=/tmp/pyx
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
timeout 200 $B/gpu_main --include-ignored --test-threads 1 gpu::flash_attention::forward_matches gpu::flash_attention::repeated gpu::sparse::sparse_forward gpu::nonfinite:: > $L/rust_fwd.log 2>&1
echo "rust forward rc=$? ($(el) s)" >> $L/summary.txt
grep -E "persistent|FAIL|panicked|test result|ERROR| NO" $L/rust_fwd.log | head -30 >> $L/summary.txt
for tool in racecheck synccheck memcheck; do
  timeout 60 compute-sanitizer --tool $tool --error-exitcode 9 python3 $N/san_fwd.py > $L/san_$tool.log 2>&1
  echo "$tool rc=$? ($(el) s): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|rel_l2' $L/san_$tool.log | tr '\n' ' ')" >> $L/summary.txt
done
timeout 120 python3 -m pytest -q -x -m "gpu or torch" tests/python/test_gpu.py tests/python/test_torch.py -p no:cacheprovider > $L/pytest.log 2>&1
echo "pytest rc=$? ($(el) s): $(tail -1 $L/pytest.log)" >> $L/summary.txt
for r in 1 2; do
  CUBEATTN_CUDA_PERSISTENT=0 timeout 60 python3 $N/ab_fwd.py off $([ $r = 1 ] && echo --cudnn) > $L/ab_off_$r.jsonl 2>$L/ab_off_$r.err
  timeout 60 python3 $N/ab_fwd.py on $([ $r = 2 ] && echo --cudnn) > $L/ab_on_$r.jsonl 2>$L/ab_on_$r.err
  echo "round $r ($(el) s)" >> $L/summary.txt
done
python3 $N/table.py $L/ab_*.jsonl > $L/table.md
cat $L/ab_*.jsonl > $L/ab.jsonl
tar czf $OUT/run.tgz -C $OUT logs
cat $L/summary.txt $L/table.md
