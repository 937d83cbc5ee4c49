#!/usr/bin/env bash
# device run 1: flash_bwd_ws_cols at 192 / 192 and 256 / 256: Rust backward suite, full-size stress,
# bench beside cuDNN (and the split kernel, CUBEATTN_BWD_SM90_WS=0), ptxas, sanitizers on head_dims
D=$(cd "$(dirname "$0")" && pwd)
cd "$(dirname "$0")/../.."
R=bench/results/h200-2026-12-03-ws-cols/run1
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} CUBEATTN_REQUIRE_GPU=1 CUBEATTN_COMMIT=$(cat $D/COMMIT)
T=$(mktemp -d); pip install -q --no-deps --target $T $D/cubeattn-*.whl >/dev/null 2>&1; export PYTHONPATH=$T
L=$(mktemp -d)/logs; mkdir -p $L
trap 'tar -C $(dirname $L) -czf $OUT/logs.tgz logs' EXIT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $L/gpu.txt
# each step's logs under $OUT as it ends (a run cut at the call's limit keeps what it had)
step() { local n=$1; shift; local t0=$(date +%s); timeout ${TMO:-200} "$@" > $L/$n.txt 2>&1; local rc=$?; echo "$n rc=$rc $(( $(date +%s)-t0 ))s" | tee -a $L/summary.txt; tar -C $(dirname $L) -czf $OUT/logs.tgz logs; }
B="python -c 'import sys, cubeattn.bench as b; sys.exit(b.main(sys.argv[1:]))'"
export CUBEATTN_CACHE_DIR=$(mktemp -d)
TMO=150 step rust_bwd $D/gpu_main --include-ignored --test-threads=1 --nocapture backward_matches_f64_reference
TMO=60 step stress python $R/stress.py 256/256 192/192
for c in gqa-d256 gqa-d192; do
  CUBEATTN_DUMP_DIR=$L/dump TMO=80 step bench_fwdbwd_$c bash -c "$B fwdbwd --config $c --dense-only --seqlens 8192 16384 --json $L/fwdbwd_$c.json"
  CUBEATTN_BWD_SM90_WS=0 TMO=60 step bench_fwdbwd_split_$c bash -c "$B fwdbwd --config $c --dense-only --seqlens 8192 --json $L/fwdbwd_split_$c.json"
done
TMO=40 step ptxas bash -c "python3 scripts/kernel_code.py count $L/dump"
CS=$(command -v compute-sanitizer || echo $CUDA_PATH/bin/compute-sanitizer)
for tool in racecheck memcheck synccheck; do
  TMO=100 step ${tool}_head_dims env CUBEATTN_CACHE_DIR=$L/kc $CS --tool $tool --error-exitcode 99 --log-file $L/$tool-head_dims.log python tests/python/sanitize_driver.py head_dims
done
rm -rf $L/kc
grep -E "test result" $L/rust*.txt; grep -E " NO |FAIL|ERROR|panicked" $L/rust*.txt | head
cat $L/stress.txt
for tool in racecheck memcheck synccheck; do grep -c FAIL $L/${tool}_head_dims.txt; tail -n 1 $L/${tool}_head_dims.txt; tail -n 1 $L/$tool-head_dims.log; done
grep -E "ws_cols|split|C75|spill" $L/ptxas.txt | head -20
cat $L/summary.txt
for f in $L/bench_*.txt; do echo "== $f"; grep -v "^#" $f | grep -v Warn | grep -v scaled_dot | awk '{print $1,$2,$3,$4,$5,$6,$7,$8}'; done
