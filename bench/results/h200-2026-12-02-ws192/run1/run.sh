#!/usr/bin/env bash
# device run 1: flash_bwd_ws192 (MLA 192 / 128 backward, three consumer warpgroups): tests, bench, ptxas, racecheck
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
TMO=170 step rust_vbwd $D/gpu_main --include-ignored --test-threads=1 --nocapture value_head_dim_of_its_own_backward
CUBEATTN_DUMP_DIR=$L/dump TMO=150 step bench_fwdbwd_$c bash -c "$B fwdbwd --config $c --dense-only --seqlens 8192 16384 --json $L/fwdbwd_$c.json"
TMO=40 step ptxas bash -c "python3 scripts/kernel_code.py count $L/dump"
CS=$(command -v compute-sanitizer || echo $CUDA_PATH/bin/compute-sanitizer)
TMO=130 step racecheck_padded env CUBEATTN_CACHE_DIR=$L/kc $CS --tool racecheck --error-exitcode 99 --log-file $L/racecheck-padded.log python tests/python/sanitize_driver.py padded
rm -rf $L/kc
CUBEATTN_BWD_SM90_WS=0 TMO=70 step bench_fwdbwd_split_$c bash -c "$B fwdbwd --config $c --dense-only --seqlens 8192 --json $L/fwdbwd_split_$c.json"
grep -E "test result" $L/rust*.txt; grep -E " NO |FAIL|ERROR|panicked" $L/rust*.txt | head
tail -n 3 $L/racecheck_padded.txt; tail -n 2 $L/racecheck-padded.log
grep -E "ws192|C75|spill" $L/ptxas.txt | head -20
cat $L/summary.txt
for f in $L/bench_*.txt; do echo "== $f"; grep -v "^#" $f | grep -v Warn | grep -v scaled_dot | awk '{print $1,$2,$3,$4,$5,$6,$7,$8}'; done
