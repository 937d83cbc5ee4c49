#!/usr/bin/env bash
# device run 3: why the sanitize driver's MLA calls fail on flash_bwd_ws192 (bisect.py), the driver without a sanitizer
D=$(cd "$(dirname "$0")" && pwd)
cd "$(dirname "$0")/../.."
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} CUBEATTN_REQUIRE_GPU=1 CUBEATTN_COMMIT=$(cat $D/COMMIT)
T=$(mktemp -d); pip install -q --no-deps --target $T $D/cubeattn-*.whl >/dev/null 2>&1; export PYTHONPATH=$T
L=$(mktemp -d)/logs; mkdir -p $L
trap 'tar -C $(dirname $L) -czf $OUT/logs.tgz logs' EXIT
step() { local n=$1; shift; local t0=$(date +%s); timeout ${TMO:-200} "$@" > $L/$n.txt 2>&1; local rc=$?; echo "$n rc=$rc $(( $(date +%s)-t0 ))s" | tee -a $L/summary.txt; }
export CUBEATTN_CACHE_DIR=$(mktemp -d)
TMO=120 step bisect python $D/bisect.py
TMO=90 step driver_padded python tests/python/sanitize_driver.py padded
cat $L/bisect.txt
grep -c FAIL $L/driver_padded.txt; grep FAIL $L/driver_padded.txt | head -5; tail -1 $L/driver_padded.txt
cat $L/summary.txt
