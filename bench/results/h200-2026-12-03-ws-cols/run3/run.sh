#!/usr/bin/env bash
# device run 3 (carries .carry/wscols2 = A, 7431794: flash_bwd_ws_cols, d256 on the dQ pass; and
# .carry/wscols3 = C, cb001e8: at d256 S on one consumer, dP on the other): C's Rust backward suite,
# stress and racecheck; fwd+bwd benches in rounds A, split (A's wheel, CUBEATTN_BWD_SM90_WS=0), C,
# SDPA cuDNN / flash in every process
D=$(cd "$(dirname "$0")" && pwd)
cd "$(dirname "$0")/../.."
A=.carry/wscols2
R=bench/results/h200-2026-12-03-ws-cols/run3
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} CUBEATTN_REQUIRE_GPU=1
TA=$(mktemp -d); pip install -q --no-deps --target $TA $A/cubeattn-*.whl >/dev/null 2>&1
TC=$(mktemp -d); pip install -q --no-deps --target $TC $D/cubeattn-*.whl >/dev/null 2>&1
L=$(mktemp -d)/logs; mkdir -p $L
trap 'tar -C $(dirname $L) -czf $OUT/logs.tgz logs' EXIT
step() { local n=$1; shift; local t0=$(date +%s); timeout ${TMO:-200} "$@" > $L/$n.txt 2>&1; local rc=$?; echo "$n rc=$rc $(( $(date +%s)-t0 ))s" | tee -a $L/summary.txt; tar -C $(dirname $L) -czf $OUT/logs.tgz logs; }
B="python -c 'import sys, cubeattn.bench as b; sys.exit(b.main(sys.argv[1:]))'"
export CUBEATTN_CACHE_DIR=$(mktemp -d)
CUBEATTN_COMMIT=$(cat $D/COMMIT) TMO=130 step rust_bwd_C $D/gpu_main --include-ignored --test-threads=1 --nocapture backward_matches_f64_reference
PYTHONPATH=$TC TMO=40 step stress_C python $R/../run1/stress.py 256/256
for r in 1 2; do
  PYTHONPATH=$TA CUBEATTN_COMMIT=$(cat $A/COMMIT) TMO=60 step A_gqa-d256_r$r bash -c "$B fwdbwd --config gqa-d256 --dense-only --seqlens 8192 16384 --json $L/A_gqa-d256_r$r.json"
  PYTHONPATH=$TA CUBEATTN_COMMIT=$(cat $A/COMMIT) CUBEATTN_BWD_SM90_WS=0 TMO=60 step split_gqa-d256_r$r bash -c "$B fwdbwd --config gqa-d256 --dense-only --seqlens 8192 16384 --json $L/split_gqa-d256_r$r.json"
  PYTHONPATH=$TC CUBEATTN_COMMIT=$(cat $D/COMMIT) TMO=60 step C_gqa-d256_r$r bash -c "$B fwdbwd --config gqa-d256 --dense-only --seqlens 8192 16384 --json $L/C_gqa-d256_r$r.json"
  PYTHONPATH=$TA CUBEATTN_COMMIT=$(cat $A/COMMIT) TMO=60 step A_gqa-d192_r$r bash -c "$B fwdbwd --config gqa-d192 --dense-only --seqlens 8192 16384 --json $L/A_gqa-d192_r$r.json"
  PYTHONPATH=$TA CUBEATTN_COMMIT=$(cat $A/COMMIT) CUBEATTN_BWD_SM90_WS=0 TMO=60 step split_gqa-d192_r$r bash -c "$B fwdbwd --config gqa-d192 --dense-only --seqlens 8192 16384 --json $L/split_gqa-d192_r$r.json"
done
CS=$(command -v compute-sanitizer || echo $CUDA_PATH/bin/compute-sanitizer)
PYTHONPATH=$TC TMO=100 step racecheck_head_dims_C env CUBEATTN_CACHE_DIR=$L/kc $CS --tool racecheck --error-exitcode 99 --log-file $L/racecheck-head_dims.log python tests/python/sanitize_driver.py head_dims
PYTHONPATH=$TC TMO=40 step memcheck_head_dims_C env CUBEATTN_CACHE_DIR=$L/kc $CS --tool memcheck --error-exitcode 99 --log-file $L/memcheck-head_dims.log python tests/python/sanitize_driver.py head_dims
rm -rf $L/kc
grep -E "test result" $L/rust*.txt; grep -E " NO |FAIL|ERROR|panicked" $L/rust*.txt | head
cat $L/stress_C.txt
tail -n 1 $L/racecheck_head_dims_C.txt $L/racecheck-head_dims.log $L/memcheck_head_dims_C.txt $L/memcheck-head_dims.log
cat $L/summary.txt
for f in $L/A_*.txt $L/split_*.txt $L/C_*.txt; do echo "== $(basename $f)"; grep -v "^#" $f | grep -E "cubeattn |cubeattn_det|sdpa_cudnn" | awk '{print $3,$4,$6,$7}' | paste -sd' ' ; done
