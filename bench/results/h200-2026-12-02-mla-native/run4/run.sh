#!/usr/bin/env bash
# device run 4 (final tree): the backward's shared tail-copy helpers; value-dim and backward suites, memcheck, pytest, bench
D=$(cd "$(dirname "$0")" && pwd)
cd "$(dirname "$0")/../.."
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} CUBEATTN_REQUIRE_GPU=1 CUBEATTN_COMMIT=$(cat $D/COMMIT)
T=$(mktemp -d); pip install -q --no-deps --target $T $D/cubeattn-*.whl >/dev/null 2>&1; export PYTHONPATH=$T
L=$(mktemp -d)/logs; mkdir -p $L
trap 'tar -C $(dirname $L) -czf $OUT/logs.tgz logs' EXIT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $L/gpu.txt
step() { local n=$1; shift; local t0=$(date +%s); timeout ${TMO:-200} "$@" > $L/$n.txt 2>&1; local rc=$?; echo "$n rc=$rc $(( $(date +%s)-t0 ))s" | tee -a $L/summary.txt; }
B="python -c 'import sys, cubeattn.bench as b; sys.exit(b.main(sys.argv[1:]))'"
c=mla-d192-v128
export CUBEATTN_CACHE_DIR=$(mktemp -d)
TMO=90 step bench_fwdbwd_$c bash -c "$B fwdbwd --config $c --dense-only --seqlens 8192 --json $L/fwdbwd_$c.json"
TMO=150 step rust_vbwd $D/gpu_main --include-ignored --test-threads=1 --nocapture value_head_dim_of_its_own_backward
TMO=130 step rust_bwd $D/gpu_main --include-ignored --test-threads=1 --nocapture backward_matches_f64_reference
TMO=80 step pytest bash -c "cd tests/python && python -m pytest -q -p no:cacheprovider test_torch.py -k 'autograd or head_dim_of_its_own or v_with or v_of_another'"
CS=$(command -v compute-sanitizer || echo $CUDA_PATH/bin/compute-sanitizer)
TMO=150 step memcheck_padded env CUBEATTN_CACHE_DIR=$L/kc $CS --tool memcheck --error-exitcode 99 --log-file $L/memcheck-padded.log python tests/python/sanitize_driver.py padded
rm -rf $L/kc
grep -E "test result" $L/rust*.txt; grep -E " NO |FAIL|ERROR|panicked" $L/rust*.txt | head
tail -n 2 $L/pytest.txt; tail -n 2 $L/memcheck_padded.txt; tail -n 2 $L/memcheck-padded.log
cat $L/summary.txt
for f in $L/bench_*.txt; do echo "== $f"; grep -v "^#" $f | grep -v Warn | grep -v scaled_dot | awk '{print $1,$2,$3,$4,$5,$6,$7,$8}'; done
