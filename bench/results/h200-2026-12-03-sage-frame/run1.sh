#!/usr/bin/env bash
# One nvidia-h200 call on the build of exp/sage-frame (.carry/sage1: wheel + gpu_main + COMMIT):
# (a) the Rust FP8 P.V suites (against the CPU emulation and the exact path; the non-finite-v
# flag) with CUBEATTN_CUDA_SAGE_FRAME=1 and 2; (b) the A/B of frames 0 / 1 / 2 in alternating
# processes (ab_sage.py, two rounds); (c) pytest test_sage / test_sparse_fp8 at frame 1;
# (d) compute-sanitizer memcheck and synccheck of small FP8 calls at frame 1; (e) bench fwdbwd
# with the zigzag_fwdbwd rows (cudnn_split_merge beside ours) while time is left.
set -u
cd "$(dirname "$0")/../../.."
B=.carry/sage1; P=bench/results/h200-2026-12-03-sage-frame
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} CUBEATTN_REQUIRE_GPU=1
export CUBEATTN_COMMIT=$(cat $B/COMMIT 2>/dev/null || echo unknown)
export CUBEATTN_CACHE_DIR=$(mktemp -d)
PYX=$(mktemp -d); timeout 120 python3 -m pip install -q --no-deps --target $PYX $B/cubeattn-*.whl > /dev/null 2>&1
export PYTHONPATH=$PYX
L=$(mktemp -d)/logs; mkdir -p $L
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
pack() { python3 $P/table.py $L/ab_*.jsonl > $L/table.md 2>/dev/null; tar -C $(dirname $L) -czf $OUT/logs.tgz logs; }
step() { local n=$1; shift; local s=$(date +%s); timeout ${TMO:-120} "$@" > $L/$n.txt 2>&1; local rc=$?; echo "$n rc=$rc $(( $(date +%s)-s ))s (at $(el) s)" | tee -a $L/summary.txt; pack; }
timeout 20 nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv > $L/gpu.txt 2>&1
for f in 1 2; do
  CUBEATTN_CUDA_SAGE_FRAME=$f TMO=150 step rust_fp8_f$f $B/gpu_main --include-ignored --test-threads 1 --nocapture int8_fp8
  grep -E "FAIL|panicked|test result|^case" $L/rust_fp8_f$f.txt | head -30 >> $L/summary.txt
done
for r in 1 2; do
  case $r in 2) order="2 1 0" ;; *) order="0 1 2" ;; esac
  for f in $order; do
    CUBEATTN_CUDA_SAGE_FRAME=$f TMO=80 step ab_f${f}_r$r bash -c "python3 $P/ab_sage.py frame$f > $L/ab_f${f}_r$r.jsonl"
  done
done
CUBEATTN_CUDA_SAGE_FRAME=1 TMO=100 step pytest_f1 python3 -m pytest -q -m "gpu or torch" tests/python/test_sage.py tests/python/test_sparse_fp8.py -p no:cacheprovider
tail -1 $L/pytest_f1.txt >> $L/summary.txt
CS=$(command -v compute-sanitizer || echo $CUDA_PATH/bin/compute-sanitizer)
for tool in memcheck synccheck; do
  CUBEATTN_CUDA_SAGE_FRAME=1 TMO=80 step san_${tool}_f1 $CS --tool $tool --error-exitcode 9 python3 bench/results/h200-2026-12-01-sage-poly/san_fp8.py
  grep -E "ERROR SUMMARY|worst" $L/san_${tool}_f1.txt >> $L/summary.txt
done
if [ $(el) -lt 430 ]; then
  TMO=$(( 560 - $(el) )) step fwdbwd_zigzag python3 -c "import sys, cubeattn.bench as b; sys.exit(b.main(sys.argv[1:]))" fwdbwd --config llama3-8b --seqlens 8192 --json $L/fwdbwd_zigzag.json
fi
pack
cat $L/summary.txt $L/table.md
grep -E "zigzag_fwdbwd|dense_fwdbwd" $L/fwdbwd_zigzag.txt 2>/dev/null | head -30
