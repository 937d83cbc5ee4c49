#!/usr/bin/env bash
# The GPU pytest files one by one (-v, so a file cut by its time limit still shows which tests
# failed), last files of the main-checks order first: that run's four unnamed failures sat at
# 70-82% of it. Build of main 37c573c (.carry/m61).
set -u
cd "$(dirname "$0")/../../.."
B=.carry/m61
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} CUBEATTN_REQUIRE_GPU=1
export CUBEATTN_COMMIT=$(cat $B/COMMIT) CUBEATTN_CACHE_DIR=$(mktemp -d)
PYX=$(mktemp -d); timeout 120 python3 -m pip install -q --no-deps --target $PYX $B/cubeattn-*.whl > /dev/null 2>&1
export PYTHONPATH=$PYX
L=$(mktemp -d)/logs; mkdir -p $L
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
pack() { tar -C $(dirname $L) -czf $OUT/logs.tgz logs; }
T=tests/python
run() { local f=$1 tmo=$2; local s=$(date +%s)
  timeout $tmo python3 -m pytest -v -rf --tb=short -m "gpu or torch" -p no:cacheprovider $T/$f > $L/$f.txt 2>&1; local rc=$?
  echo "$f rc=$rc $(( $(date +%s)-s ))s: $(grep -cE ' PASSED' $L/$f.txt) passed, $(grep -cE ' FAILED' $L/$f.txt) failed; $(tail -1 $L/$f.txt | cut -c1-120)" | tee -a $L/summary.txt
  grep -E " FAILED|^E " $L/$f.txt | head -8 | cut -c1-220; pack; }
run test_compile_gpu.py 60
run test_sparse_gpu.py 80
run test_nonfinite.py 60
run test_decode_gpu.py 60
run test_kvcache_gpu.py 60
run test_zigzag_gpu.py 70
run test_window_gpu.py 60
[ $(el) -lt 470 ] && run test_gpu.py $(( 560 - $(el) ))
pack
echo; cat $L/summary.txt
