#!/usr/bin/env bash
# Build of ed39011 (.carry/s62b): compute-sanitizer over the launches in the orders the new rules
# take, forced for every call (CUBEATTN_FWD_ORDER / BWD_ORDER / DQ_ORDER=kv): memcheck of the
# window, forward and backward_pass families, then synccheck of window.
set -u
cd "$(dirname "$0")/../../.."
B=.carry/s62b
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} CUBEATTN_REQUIRE_GPU=1
L=$(mktemp -d)/logs; mkdir -p $L
pack() { tar -C $(dirname $L) -czf $OUT/logs.tgz logs; }
export CUBEATTN_FWD_ORDER=kv CUBEATTN_BWD_ORDER=kv CUBEATTN_DQ_ORDER=kv CUBEATTN_WHEEL=$(ls $B/cubeattn-*.whl)
s=$(date +%s)
SAN_TOOLS=memcheck SAN_FAMILIES="window forward backward_pass" SAN_DIR=$L/memcheck timeout 330 scripts/gpu-test.sh sanitize > $L/memcheck.txt 2>&1
echo "memcheck rc=$? $(( $(date +%s)-s ))s"; pack
s=$(date +%s)
SAN_TOOLS=synccheck SAN_FAMILIES="window" SAN_DIR=$L/synccheck timeout 120 scripts/gpu-test.sh sanitize > $L/synccheck.txt 2>&1
echo "synccheck rc=$? $(( $(date +%s)-s ))s"; pack
cat $L/memcheck/summary.txt $L/synccheck/summary.txt 2>/dev/null
grep -h "failed checks" $L/memcheck/*.out $L/synccheck/*.out 2>/dev/null
