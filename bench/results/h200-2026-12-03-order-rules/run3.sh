#!/usr/bin/env bash
# Build of ed39011 (.carry/s62b), the warm machine of run2: test_window_gpu.py whole (run2 cut it
# at 100 s, 64 passed, none failed), then `bench fwdbwd`'s grouped zigzag rows, W = 8 included
# (the dense rows at 1K only, to keep the call short).
set -u
cd "$(dirname "$0")/../../.."
B=.carry/s62b
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} CUBEATTN_REQUIRE_GPU=1
export CUBEATTN_COMMIT=$(cat $B/COMMIT) CUBEATTN_CACHE_DIR=$(mktemp -d)
PYX=$(mktemp -d); timeout 120 python3 -m pip install -q --no-deps --target $PYX $B/cubeattn-*.whl > /dev/null 2>&1
export PYTHONPATH=$PYX
L=$(mktemp -d)/logs; mkdir -p $L
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
pack() { tar -C $(dirname $L) -czf $OUT/logs.tgz logs; }
step() { local n=$1; shift; local s=$(date +%s); timeout ${TMO:-120} "$@" > $L/$n.txt 2>&1; local rc=$?; echo "$n rc=$rc $(( $(date +%s)-s ))s (at $(el) s)" | tee -a $L/summary.txt; pack; }
BENCH="python3 -c 'import sys, cubeattn.bench as b; sys.exit(b.main(sys.argv[1:]))'"
TMO=200 step window python3 -m pytest -v -rf --tb=short -m "gpu or torch" -p no:cacheprovider tests/python/test_window_gpu.py
grep -hE " passed| failed|FAILED|^E " $L/window.txt | tail -6 | cut -c1-200
TMO=300 step zigzag_fwdbwd bash -c "$BENCH fwdbwd --config llama3-8b --seqlens 1024 --json $L/fwdbwd.json"
pack
cat $L/summary.txt
tail -30 $L/zigzag_fwdbwd.txt
