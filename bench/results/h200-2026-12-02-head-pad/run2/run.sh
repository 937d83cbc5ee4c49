#!/usr/bin/env bash
# device run 2: head dims without a kernel pad to the wgmma head dims on Hopper (80 -> 128)
D=$(cd "$(dirname "$0")" && pwd)
cd "$(dirname "$0")/../.."
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} CUBEATTN_REQUIRE_GPU=1 CUBEATTN_COMMIT=$(cat $D/COMMIT)
T=$(mktemp -d); pip install -q --no-deps --target $T $D/cubeattn-*.whl >/dev/null 2>&1; export PYTHONPATH=$T
L=$(mktemp -d)/logs; mkdir -p $L
trap 'tar -C $(dirname $L) -czf $OUT/logs.tgz logs' EXIT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $L/gpu.txt
step() { local n=$1; shift; local t0=$(date +%s); "$@" > $L/$n.txt 2>&1; local rc=$?; echo "$n rc=$rc $(( $(date +%s)-t0 ))s" | tee -a $L/summary.txt; }
B="python -c 'import sys, cubeattn.bench as b; sys.exit(b.main(sys.argv[1:]))'"
for c in gqa-d80 gqa-d96 llama3-8b; do
  step bench_dense_$c bash -c "$B dense --config $c --seqlens 8192 16384 --json $L/dense_$c.json"
  step bench_fwdbwd_$c bash -c "$B fwdbwd --config $c --dense-only --seqlens 8192 --json $L/fwdbwd_$c.json"
done
step rust_fwd env CUBEATTN_GPU_VARIANTS=default,mma-sync $D/gpu_main --include-ignored --test-threads=1 --nocapture forward_matches_f64_reference
step rust_bwd $D/gpu_main --include-ignored --test-threads=1 --nocapture backward_matches_f64_reference backward_unsupported_head_dim
step pytest bash -c "cd tests/python && python -m pytest -q -p no:cacheprovider test_torch.py -k 'head_dims or refuses' && python -m pytest -q -p no:cacheprovider test_properties_gpu.py"
step memcheck bash -c "compute-sanitizer --tool memcheck --error-exitcode 99 python tests/python/sanitize_driver.py padded"
grep -E "test result" $L/rust_fwd.txt $L/rust_bwd.txt; grep -E " NO|FAIL" $L/rust_fwd.txt $L/rust_bwd.txt | head
tail -n 2 $L/pytest.txt; grep -E "ERROR SUMMARY|FAIL" $L/memcheck.txt | head -5
cat $L/summary.txt
for f in $L/bench_*.txt; do grep -v "^#" $f | awk '{print $1,$2,$3,$4,$6,$7}'; done
