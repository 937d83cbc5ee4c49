#!/usr/bin/env bash
# Prepared for the next GPU call (not yet run): branch exp/sage-poly-exp2, one build (B: wheel +
# gpu_main + COMMIT). (a) A/B of CUBEATTN_CUDA_SAGE_POLY=0 / 1 / 2 (none / a quarter / half of the
# INT8 sage kernels' softmax exponentials by polynomial instead of MUFU.EX2) in alternating
# processes, three rounds: ab_sage.py (B4 H32 d128 8K / 16K, causal and not; sageattn FP8 P.V and
# INT8 beside our bf16 forward and SDPA cuDNN, in turns; cosine against f64); (b) the Rust
# sparse_int8 GPU suites (FP8 against the CPU emulation and the exact path) and pytest test_sage /
# test_sparse_fp8 (-m "gpu or torch") with the switch at 1, then at 2 while time is left; (c)
# compute-sanitizer memcheck of san_fp8.py (small FP8 calls) at 1, then 2. One nvidia-h200 call,
# about 6 minutes.
set -u
export CUDA_PATH=/usr/local/cuda
B=.carry/s53p; P=bench/results/h200-2026-12-01-sage-poly
export CUBEATTN_COMMIT=$(cat $B/COMMIT 2>/dev/null || echo unknown)
L=$OUT/logs; mkdir -p $L
PYX=$(mktemp -d)
timeout 120 python3 -m pip install -q --no-deps --target $PYX $B/cubeattn-*.whl > $L/pip.log 2>&1
export PYTHONPATH=$PYX
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
timeout 20 nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv > $L/gpu.txt 2>&1
pack() { python3 $P/table.py $L/ab_*.jsonl > $L/table.md 2>/dev/null; tar czf $OUT/run.tgz -C $OUT logs; }
for r in 1 2 3; do
  case $r in 2) order="1 0" ;; *) order="0 1" ;; esac
  for p in $order; do
    CUBEATTN_CUDA_SAGE_POLY=$p timeout 75 python3 $P/ab_sage.py poly$p > $L/ab_poly${p}_$r.jsonl 2> $L/ab_poly${p}_$r.err
    echo "round $r poly $p rc=$? ($(el) s)" >> $L/summary.txt
  done
  pack
done
timeout 60 python3 $P/prof_sage.py > $L/prof_sage.txt 2>&1
echo "profile rc=$? ($(el) s)" >> $L/summary.txt; pack
for p in 1 2; do
  if [ $p = 2 ] && [ $(el) -gt 290 ]; then echo "checks at poly 2 skipped ($(el) s)" >> $L/summary.txt; break; fi
  CUBEATTN_CUDA_SAGE_POLY=$p timeout 150 $B/gpu_main --include-ignored --test-threads 1 --nocapture sparse_int8 > $L/rust_poly$p.log 2>&1
  echo "rust sparse_int8 poly $p rc=$? ($(el) s)" >> $L/summary.txt
  grep -E "FAIL|panicked|test result" $L/rust_poly$p.log | head -20 >> $L/summary.txt
  CUBEATTN_CUDA_SAGE_POLY=$p timeout 100 python3 -m pytest -q -m "gpu or torch" tests/python/test_sage.py tests/python/test_sparse_fp8.py -p no:cacheprovider > $L/pytest_poly$p.log 2>&1
  echo "pytest poly $p rc=$? ($(el) s): $(tail -1 $L/pytest_poly$p.log)" >> $L/summary.txt
  pack
done
for p in 1 2; do
  if [ $p = 2 ] && [ $(el) -gt 360 ]; then echo "memcheck at poly 2 skipped ($(el) s)" >> $L/summary.txt; break; fi
  CUBEATTN_CUDA_SAGE_POLY=$p timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 python3 $P/san_fp8.py > $L/san_memcheck_poly$p.log 2>&1
  echo "memcheck poly $p rc=$? ($(el) s): $(grep -E 'ERROR SUMMARY|worst' $L/san_memcheck_poly$p.log | tr '\n' ' ')" >> $L/summary.txt
  pack
done
cat $L/summary.txt $L/table.md
