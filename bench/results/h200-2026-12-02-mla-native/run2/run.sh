#!/usr/bin/env bash
# device run 2 (artifacts of .carry/s57a, b86f98c): the MLA torch call profiled, the rest of the value-dim tests
D=$(cd "$(dirname "$0")" && pwd); A=$D/../s57a
cd "$(dirname "$0")/../.."
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} CUBEATTN_REQUIRE_GPU=1 CUBEATTN_COMMIT=$(cat $A/COMMIT)
T=$(mktemp -d); pip install -q --no-deps --target $T $A/cubeattn-*.whl >/dev/null 2>&1; export PYTHONPATH=$T
L=$(mktemp -d)/logs; mkdir -p $L
trap 'tar -C $(dirname $L) -czf $OUT/logs.tgz logs' EXIT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $L/gpu.txt
step() { local n=$1; shift; local t0=$(date +%s); timeout ${TMO:-200} "$@" > $L/$n.txt 2>&1; local rc=$?; echo "$n rc=$rc $(( $(date +%s)-t0 ))s" | tee -a $L/summary.txt; }
SHAPES="8192:192 16384:192" TMO=60 step prof python $D/prof.py
TMO=300 step rust_fwd $A/gpu_main --include-ignored --test-threads=1 --nocapture value_head_dim_of_its_own_matches
TMO=170 step rust_bwd $A/gpu_main --include-ignored --test-threads=1 --nocapture value_head_dim_of_its_own_backward
grep -E "test result" $L/rust*.txt; grep -E " NO |FAIL|ERROR|panicked" $L/rust*.txt | head
grep -c " ok " $L/rust_fwd.txt; grep -c "ok\b" $L/rust_bwd.txt
cat $L/summary.txt
grep -E "==|ms  " $L/prof.txt | head -40
