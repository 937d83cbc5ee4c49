#!/usr/bin/env bash
# device run: the head_dim 32 backward on the d64 wgmma kernels (head_pad) on Hopper
D=$(cd "$(dirname "$0")" && pwd)
cd "$(dirname "$0")/../.."
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} CUBEATTN_REQUIRE_GPU=1 CUBEATTN_COMMIT=$(cat $D/COMMIT)
T=$(mktemp -d); pip install -q --no-deps --target $T $D/cubeattn-*.whl >/dev/null 2>&1; export PYTHONPATH=$T
L=$(mktemp -d)/logs; mkdir -p $L
trap 'tar -C $(dirname $L) -czf $OUT/logs.tgz logs' EXIT
step() { local n=$1; shift; local t0=$(date +%s); timeout ${TMO:-200} "$@" > $L/$n.txt 2>&1; local rc=$?; echo "$n rc=$rc $(( $(date +%s)-t0 ))s" | tee -a $L/summary.txt; }
B="python -c 'import sys, cubeattn.bench as b; sys.exit(b.main(sys.argv[1:]))'"
TMO=150 step bench_fwdbwd_gqa-d32 bash -c "$B fwdbwd --config gqa-d32 --dense-only --seqlens 8192 16384 --json $L/fwdbwd_gqa-d32.json"
TMO=60 step bench_dense_gqa-d32 bash -c "$B dense --config gqa-d32 --seqlens 8192 --json $L/dense_gqa-d32.json"
TMO=150 step rust_bwd $D/gpu_main --include-ignored --test-threads=1 --nocapture backward_matches_f64_reference
TMO=100 step pytest bash -c "cd tests/python && python -m pytest -q -p no:cacheprovider test_torch.py -k 'autograd_matches or head_dim_of_its_own or v_with'"
tail -n 2 $L/pytest.txt
grep -E "test result" $L/rust_bwd.txt; grep -E "FAIL|ERROR" $L/rust_bwd.txt | head; grep -E "d32" $L/rust_bwd.txt | cut -c1-150
cat $L/summary.txt
for f in $L/bench_*.txt; do grep -v "^#" $f | grep -v Warn | grep -v scaled_dot | awk '{print $1,$2,$3,$4,$5,$6,$7,$8}'; done
