#!/usr/bin/env bash
# device run: padded head dims (correctness, memcheck, timing beside SDPA)
D=$(cd "$(dirname "$0")" && pwd)
cd "$(dirname "$0")/../.."
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} CUBEATTN_REQUIRE_GPU=1 CUBEATTN_COMMIT=$(cat $D/COMMIT)
T=$(mktemp -d); pip install -q --no-deps --target $T $D/cubeattn-*.whl >/dev/null 2>&1; export PYTHONPATH=$T
L=$OUT/logs; mkdir -p $L
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $L/gpu.txt
step() { local n=$1; shift; local t0=$(date +%s); "$@" > $L/$n.txt 2>&1; local rc=$?; echo "$n rc=$rc $(( $(date +%s)-t0 ))s" | tee -a $L/summary.txt; }
MODE=${1:-check}
if [ $MODE = check ]; then
step rust_fwd $D/gpu_main --include-ignored --test-threads=1 forward_matches_f64_reference
step rust_bwd $D/gpu_main --include-ignored --test-threads=1 backward_matches_f64_reference backward_unsupported_head_dim
step rust_sparse $D/gpu_main --include-ignored --test-threads=1 sparse_forward_matches sparse_backward_matches
fi
if [ $MODE = check ] || [ $MODE = rest ]; then
step pytest bash -c "cd tests/python && python -m pytest -q -p no:cacheprovider test_torch.py -k 'head_dims or refuses' && python -m pytest -q -p no:cacheprovider test_properties_gpu.py test_sparse.py::test_cuda_without_a_kernel_for_the_call_is_refused_and_auto_runs_on_the_cpu"
step memcheck bash -c "compute-sanitizer --tool memcheck --error-exitcode 99 python tests/python/sanitize_driver.py padded"
fi
if [ $MODE = bench ] || [ $MODE = rest ]; then
B="python -c 'import sys, cubeattn.bench as b; b.CONFIGS.update({\"gqa-d80\": (32, 8, 80), \"gqa-d160\": (16, 8, 160)}); sys.exit(b.main(sys.argv[1:]))'"
for c in gqa-d80 gqa-d96 gqa-d160 gqa-d192; do
  step bench_dense_$c bash -c "$B dense --config $c --seqlens 8192 16384 --json $L/dense_$c.json"
  step bench_fwdbwd_$c bash -c "$B fwdbwd --config $c --dense-only --seqlens 8192 --json $L/fwdbwd_$c.json"
done
fi
tail -n 30 $L/rust_fwd.txt | grep -E "test result|FAIL|NO" | head
grep -E "^d|test result|FAIL" $L/rust_bwd.txt | grep -E "FAIL|test result" | head
tail -n 3 $L/pytest.txt; grep -E "ERROR SUMMARY|FAIL" $L/memcheck.txt | head -5
cat $L/summary.txt
