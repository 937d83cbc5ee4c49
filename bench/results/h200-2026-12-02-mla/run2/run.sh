#!/usr/bin/env bash
# device run 2: v with a head_dim of its own: pytest (fixed f32 case, head dims), memcheck of the
# padded family (now with 192/128 and 64/128), the Rust backward suite (padded head dims)
D=$(cd "$(dirname "$0")" && pwd)
cd "$(dirname "$0")/../.."
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} CUBEATTN_REQUIRE_GPU=1 CUBEATTN_COMMIT=$(cat $D/COMMIT)
T=$(mktemp -d); pip install -q --no-deps --target $T $D/cubeattn-*.whl >/dev/null 2>&1; export PYTHONPATH=$T
L=$(mktemp -d)/logs; mkdir -p $L
trap 'tar -C $(dirname $L) -czf $OUT/logs.tgz logs' EXIT
step() { local n=$1; shift; local t0=$(date +%s); timeout ${TMO:-200} "$@" > $L/$n.txt 2>&1; local rc=$?; echo "$n rc=$rc $(( $(date +%s)-t0 ))s" | tee -a $L/summary.txt; }
TMO=120 step pytest bash -c "cd tests/python && python -m pytest -q -p no:cacheprovider test_torch.py -k 'head_dim_of_its_own or v_with or v_of_another or head_dims'"
CS=$(command -v compute-sanitizer || echo $CUDA_PATH/bin/compute-sanitizer)
TMO=260 step memcheck_padded env CUBEATTN_CACHE_DIR=$L/kc $CS --tool memcheck --error-exitcode 99 --log-file $L/memcheck-padded.log python tests/python/sanitize_driver.py padded
rm -rf $L/kc
TMO=180 step rust_bwd $D/gpu_main --include-ignored --test-threads=1 --nocapture backward_matches_f64_reference
tail -n 2 $L/pytest.txt
grep -E "SUMMARY" $L/memcheck-padded.log; grep -c " ok" $L/memcheck_padded.txt; grep FAIL $L/memcheck_padded.txt | head
grep -E "test result" $L/rust_bwd.txt; grep -E "FAIL|ERROR" $L/rust_bwd.txt | head
cat $L/summary.txt
