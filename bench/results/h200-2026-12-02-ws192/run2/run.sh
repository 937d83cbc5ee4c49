#!/usr/bin/env bash
# device run 2: flash_bwd_ws192 with the producer at 24 registers: full-size stress, racecheck, memcheck, synccheck, bench
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
TMO=110 step stress python $D/stress.py
CUBEATTN_DUMP_DIR=$L/dump TMO=100 step bench_fwdbwd_$c bash -c "$B fwdbwd --config $c --dense-only --seqlens 8192 16384 --json $L/fwdbwd_$c.json"
TMO=40 step ptxas bash -c "python3 scripts/kernel_code.py count $L/dump"
# the backward sources dumped by the build machine (kernel_dump.rs), compiled by this box's NVRTC
TMO=60 step ptxas_bwd bash -c "python3 scripts/kernel_code.py count $D/dump"
CS=$(command -v compute-sanitizer || echo $CUDA_PATH/bin/compute-sanitizer)
for tool in racecheck memcheck synccheck; do
  TMO=110 step ${tool}_padded env CUBEATTN_CACHE_DIR=$L/kc $CS --tool $tool --error-exitcode 99 --log-file $L/$tool-padded.log python tests/python/sanitize_driver.py padded
done
rm -rf $L/kc
cat $L/stress.txt
for tool in racecheck memcheck synccheck; do grep -c FAIL $L/${tool}_padded.txt; tail -n 1 $L/${tool}_padded.txt; tail -n 1 $L/$tool-padded.log; done
grep -E "^==|C75|spill" $L/ptxas*.txt | head -20
cat $L/summary.txt
for f in $L/bench_*.txt; do echo "== $f"; grep -v "^#" $f | grep -v Warn | grep -v scaled_dot | awk '{print $1,$2,$3,$4,$5,$6,$7,$8}'; done
