#!/usr/bin/env bash
# device run: the final tree's Rust forward suite (default variant: the padded head dims, d32
# backward unchanged in the forward), v-head-dim suites, and the GPU property tests
D=$(cd "$(dirname "$0")" && pwd)
cd "$(dirname "$0")/../.."
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} CUBEATTN_REQUIRE_GPU=1 CUBEATTN_COMMIT=$(cat $D/COMMIT)
T=$(mktemp -d); pip install -q --no-deps --target $T $D/cubeattn-*.whl >/dev/null 2>&1; export PYTHONPATH=$T
L=$(mktemp -d)/logs; mkdir -p $L
trap 'tar -C $(dirname $L) -czf $OUT/logs.tgz logs' EXIT
step() { local n=$1; shift; local t0=$(date +%s); timeout ${TMO:-200} "$@" > $L/$n.txt 2>&1; local rc=$?; echo "$n rc=$rc $(( $(date +%s)-t0 ))s" | tee -a $L/summary.txt; }
TMO=280 step rust_fwd env CUBEATTN_GPU_VARIANTS=default $D/gpu_main --include-ignored --test-threads=1 --nocapture forward_matches_f64_reference
TMO=120 step pytest_props bash -c "cd tests/python && python -m pytest -q -p no:cacheprovider test_properties_gpu.py -x"
grep -E "test result" $L/rust_fwd.txt; grep -E " NO|ERROR" $L/rust_fwd.txt | head
tail -n 2 $L/pytest_props.txt
cat $L/summary.txt
