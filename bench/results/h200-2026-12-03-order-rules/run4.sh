#!/usr/bin/env bash
# Build of ed39011 (.carry/s62b), warm machine: `bench dense` (issue 40's rows) at d128 and d64,
# causal and not, 4K-32K, the torch calls in turns with SDPA cuDNN and flash.
set -u
cd "$(dirname "$0")/../../.."
B=.carry/s62b
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} CUBEATTN_REQUIRE_GPU=1
export CUBEATTN_COMMIT=$(cat $B/COMMIT) CUBEATTN_CACHE_DIR=$(mktemp -d)
PYX=$(mktemp -d); timeout 120 python3 -m pip install -q --no-deps --target $PYX $B/cubeattn-*.whl > /dev/null 2>&1
export PYTHONPATH=$PYX
L=$(mktemp -d)/logs; mkdir -p $L
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
pack() { tar -C $(dirname $L) -czf $OUT/logs.tgz logs; }
step() { local n=$1; shift; local s=$(date +%s); timeout ${TMO:-120} "$@" > $L/$n.txt 2>&1; local rc=$?; echo "$n rc=$rc $(( $(date +%s)-s ))s (at $(el) s)" | tee -a $L/summary.txt; pack; }
BENCH="python3 -c 'import sys, cubeattn.bench as b; sys.exit(b.main(sys.argv[1:]))'"
for c in llama3-8b gqa-d64; do
  for m in --causal --no-causal; do
    TMO=100 step dense_${c}${m} bash -c "$BENCH dense --config $c $m --seqlens 4096 8192 16384 32768 --json $L/dense_${c}${m}.json"
  done
done
pack
cat $L/summary.txt
grep -h "dense_fwd" $L/dense_*.txt | grep -v "^what"
