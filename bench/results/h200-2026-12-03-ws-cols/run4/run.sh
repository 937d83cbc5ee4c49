#!/usr/bin/env bash
# device run 4: the final tree (flash_bwd_ws_cols at 192 only; 256 back on the split kernel):
# Rust backward and value-dim suites, stress at 192 / 192 and 256 / 256, the padded sanitize-driver
# family, fwd+bwd benches at 8K beside SDPA cuDNN / flash
D=$(cd "$(dirname "$0")" && pwd)
cd "$(dirname "$0")/../.."
R=bench/results/h200-2026-12-03-ws-cols
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} CUBEATTN_REQUIRE_GPU=1 CUBEATTN_COMMIT=$(cat $D/COMMIT)
T=$(mktemp -d); pip install -q --no-deps --target $T $D/cubeattn-*.whl >/dev/null 2>&1; export PYTHONPATH=$T
L=$(mktemp -d)/logs; mkdir -p $L
trap 'tar -C $(dirname $L) -czf $OUT/logs.tgz logs' EXIT
step() { local n=$1; shift; local t0=$(date +%s); timeout ${TMO:-200} "$@" > $L/$n.txt 2>&1; local rc=$?; echo "$n rc=$rc $(( $(date +%s)-t0 ))s" | tee -a $L/summary.txt; tar -C $(dirname $L) -czf $OUT/logs.tgz logs; }
B="python -c 'import sys, cubeattn.bench as b; sys.exit(b.main(sys.argv[1:]))'"
export CUBEATTN_CACHE_DIR=$(mktemp -d)
TMO=120 step rust_bwd $D/gpu_main --include-ignored --test-threads=1 --nocapture backward_matches_f64_reference
TMO=110 step rust_vbwd $D/gpu_main --include-ignored --test-threads=1 --nocapture value_head_dim_of_its_own_backward
TMO=40 step stress python $R/run1/stress.py 192/192 256/256
TMO=60 step driver_padded python tests/python/sanitize_driver.py padded
for c in gqa-d192 gqa-d256 mla-d192-v128; do
  TMO=40 step bench_$c bash -c "$B fwdbwd --config $c --dense-only --seqlens 8192 --json $L/fwdbwd_$c.json"
done
grep -E "test result" $L/rust*.txt; grep -E " NO |FAIL|ERROR|panicked" $L/rust*.txt | head
cat $L/stress.txt; grep -c FAIL $L/driver_padded.txt; tail -1 $L/driver_padded.txt
cat $L/summary.txt
for f in $L/bench_*.txt; do echo "== $(basename $f)"; grep -v "^#" $f | grep -E "cubeattn |cubeattn_det|sdpa_cudnn" | awk '{print $3,$4,$6,$7}' | paste -sd' ' ; done
