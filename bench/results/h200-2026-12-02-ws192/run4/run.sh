#!/usr/bin/env bash
# device run 4: the plan-key fix; the sanitize driver's padded family without and under the three sanitizers, Rust value-dim and backward suites, stress
D=$(cd "$(dirname "$0")" && pwd)
cd "$(dirname "$0")/../.."
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} CUBEATTN_REQUIRE_GPU=1 CUBEATTN_COMMIT=$(cat $D/COMMIT)
T=$(mktemp -d); pip install -q --no-deps --target $T $D/cubeattn-*.whl >/dev/null 2>&1; export PYTHONPATH=$T
L=$(mktemp -d)/logs; mkdir -p $L
trap 'tar -C $(dirname $L) -czf $OUT/logs.tgz logs' EXIT
step() { local n=$1; shift; local t0=$(date +%s); timeout ${TMO:-200} "$@" > $L/$n.txt 2>&1; local rc=$?; echo "$n rc=$rc $(( $(date +%s)-t0 ))s" | tee -a $L/summary.txt; }
export CUBEATTN_CACHE_DIR=$(mktemp -d)
TMO=90 step driver_padded python tests/python/sanitize_driver.py padded
CS=$(command -v compute-sanitizer || echo $CUDA_PATH/bin/compute-sanitizer)
for tool in racecheck memcheck synccheck; do
  TMO=110 step ${tool}_padded env CUBEATTN_CACHE_DIR=$L/kc $CS --tool $tool --error-exitcode 99 --log-file $L/$tool-padded.log python tests/python/sanitize_driver.py padded
done
rm -rf $L/kc
TMO=60 step stress python $D/../run2/stress.py
TMO=150 step rust_vbwd $D/gpu_main --include-ignored --test-threads=1 --nocapture value_head_dim_of_its_own_backward
TMO=110 step rust_bwd $D/gpu_main --include-ignored --test-threads=1 --nocapture backward_matches_f64_reference
grep -c FAIL $L/driver_padded.txt; tail -1 $L/driver_padded.txt
for tool in racecheck memcheck synccheck; do grep -c FAIL $L/${tool}_padded.txt; tail -n 1 $L/${tool}_padded.txt; tail -n 1 $L/$tool-padded.log; done
cat $L/stress.txt
grep -E "test result" $L/rust*.txt; grep -E " NO |FAIL|panicked" $L/rust*.txt | head
cat $L/summary.txt
