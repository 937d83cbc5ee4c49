#!/usr/bin/env bash
# session 51, call 1: lse x log2 e from bwd_delta (Hopper dK/dV kernels) + the dQ pass unmasked loop: correctness, then A/B vs main's build
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_PATH=/usr/local/cuda
NEW=BUILD_DIR; BASE=BUILD_DIR; R=bench/results/h200-2026-12-01-lse2-dqmask
L=$OUT/logs; mkdir -p $L
python3 -m pip install -q --no-deps --target /tmp/pyx_new $NEW/cubeattn-*.whl > $L/pip.log 2>&1
python3 -m pip install -q --no-deps --target /tmp/pyx_base $BASE/cubeattn-*.whl >> $L/pip.log 2>&1
t0=$(date +%s)
timeout 290 $NEW/gpu_main --include-ignored --test-threads 1 gpu::backward:: gpu::nonfinite:: gpu::sparse::sparse_backward > $L/rust_bwd.log 2>&1; echo "rust backward+nonfinite rc=$? ($(( $(date +%s) - t0 )) s)" | tee $L/summary.txt
grep -E "FAIL|panicked|test result|ERROR" $L/rust_bwd.log | head -20 >> $L/summary.txt
PYTHONPATH=/tmp/pyx_new timeout 100 python3 -m pytest -q -x -m "gpu or torch" tests/python/test_backward.py tests/python/test_torch.py tests/python/test_nonfinite.py -p no:cacheprovider > $L/pytest.log 2>&1; echo "pytest rc=$? ($(( $(date +%s) - t0 )) s)" >> $L/summary.txt
tail -2 $L/pytest.log >> $L/summary.txt
for r in 1 2; do
  PYTHONPATH=/tmp/pyx_base timeout 90 python3 bench/results/h200-2026-11-30-dsfull/ab.py main --det $([ $r = 1 ] && echo --cudnn) > $L/ab_base_$r.jsonl 2>$L/ab_base_$r.err
  PYTHONPATH=/tmp/pyx_new timeout 90 python3 bench/results/h200-2026-11-30-dsfull/ab.py lse2 --det $([ $r = 2 ] && echo --cudnn) > $L/ab_new_$r.jsonl 2>$L/ab_new_$r.err
  echo "round $r $(( $(date +%s) - t0 )) s" >> $L/summary.txt
done
python3 bench/results/h200-2026-11-30-dsfull/table.py $L/ab_*.jsonl > $L/table.md
tar czf $OUT/run.tgz -C $OUT logs
cat $L/summary.txt $L/table.md
