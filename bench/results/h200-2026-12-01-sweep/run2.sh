#!/usr/bin/env bash
# session 51, call 2 (one H200): main's build (3f27862): the torch step's timeline at 4K
# non-causal, then the GPU pytest files the last sweeps did not finish
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_PATH=/usr/local/cuda
B=BUILD_DIR
L=$OUT/logs; mkdir -p $L
python3 -m pip install -q --no-deps --target /tmp/pyx $B/cubeattn-*.whl > $L/pip.log 2>&1
export PYTHONPATH=/tmp/pyx
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
SHAPES="4096:0" timeout 60 python3 scripts/step_profile.py > $L/prof_d128.txt 2>&1
D=64 SHAPES="4096:0" timeout 50 python3 scripts/step_profile.py > $L/prof_d64.txt 2>&1
echo "profiles ($(el) s)" >> $L/summary.txt
for f in test_sparse_gpu test_window_gpu test_transformers_gpu test_stress test_zigzag; do
  left=$(( 560 - $(el) ))
  [ $left -lt 20 ] && { echo "$f not run (time)" >> $L/summary.txt; continue; }
  timeout $left python3 -m pytest -q -m "gpu or torch" tests/python/$f.py -p no:cacheprovider > $L/pytest_$f.log 2>&1
  echo "$f rc=$? ($(el) s): $(tail -1 $L/pytest_$f.log)" >> $L/summary.txt
done
grep -h "^== \|rust" $L/prof_d*.txt >> $L/summary.txt
tar czf $OUT/run.tgz -C $OUT logs
cat $L/summary.txt; grep -A40 "== cubeattn" $L/prof_d128.txt | grep "+ " | head -30; grep -A40 "== sdpa_cudnn" $L/prof_d128.txt | grep "+ " | head -20
