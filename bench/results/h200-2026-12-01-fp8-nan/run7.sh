#!/usr/bin/env bash
# One nvidia-h200 call on the fix (branch fix/fp8-odd-tiles, build B): the GPU pytest of
# test_sage.py (its two new FP8 cases among them) and test_sparse_fp8.py, dbg2.py's NaN counts,
# the Rust sparse_int8 suites, memcheck of san_fp8.py, and an A/B of the sage call against main's
# build (M) in alternating processes.
set -u
export CUDA_PATH=/usr/local/cuda
B=.carry/s53g; M=.carry/s52x; N=bench/results/h200-2026-12-01-fp8-nan; P=bench/results/h200-2026-12-01-sage-poly
export CUBEATTN_COMMIT=$(cat $B/COMMIT 2>/dev/null || echo unknown)
L=$OUT/logs; mkdir -p $L
PYB=$(mktemp -d); PYM=$(mktemp -d)
python3 -m pip install -q --no-deps --target $PYB $B/cubeattn-*.whl > $L/pip.log 2>&1
python3 -m pip install -q --no-deps --target $PYM $M/cubeattn-*.whl >> $L/pip.log 2>&1
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
pack() { tar czf $OUT/run.tgz -C $OUT logs; }
PYTHONPATH=$PYB timeout 150 python3 -m pytest -q -m "gpu or torch" tests/python/test_sage.py tests/python/test_sparse_fp8.py -p no:cacheprovider -rA > $L/pytest.log 2>&1
echo "pytest rc=$? ($(el) s): $(tail -1 $L/pytest.log)" >> $L/summary.txt; pack
# the new test against main's build: it must fail there
PYTHONPATH=$PYM timeout 90 python3 -m pytest -q -m "gpu or torch" tests/python/test_sage.py -k "key_blocks_past" -p no:cacheprovider > $L/pytest_main.log 2>&1
echo "pytest key_blocks_past on main's build rc=$? ($(el) s): $(tail -1 $L/pytest_main.log)" >> $L/summary.txt; pack
PYTHONPATH=$PYB timeout 60 python3 $N/dbg2.py > $L/dbg2_fixed.txt 2>&1; echo "dbg2 rc=$? ($(el) s)" >> $L/summary.txt; pack
timeout 120 $B/gpu_main --include-ignored --test-threads 1 --nocapture sparse_int8 > $L/rust_sparse_int8.log 2>&1
echo "rust sparse_int8 rc=$? ($(el) s): $(grep 'test result' $L/rust_sparse_int8.log | tr '\n' ' ')" >> $L/summary.txt; pack
PYTHONPATH=$PYB timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 python3 $P/san_fp8.py > $L/san_memcheck.log 2>&1
echo "memcheck rc=$? ($(el) s): $(grep -E 'ERROR SUMMARY|worst' $L/san_memcheck.log | tr '\n' ' ')" >> $L/summary.txt; pack
for r in 1 2; do
  for b in fix main; do
    py=$PYB; [ $b = main ] && py=$PYM
    PYTHONPATH=$py timeout 60 python3 $P/ab_sage.py $b 10 > $L/ab_${b}_$r.jsonl 2> $L/ab_${b}_$r.err
    echo "ab $b round $r rc=$? ($(el) s)" >> $L/summary.txt
  done
  pack
done
cat $L/summary.txt; cat $L/dbg2_fixed.txt; grep -E "non-finite|FAILED|passed|failed" $L/pytest.log | tail -8
python3 - $L <<'P'
import json, sys, glob, statistics as st, collections
t = collections.defaultdict(list)
for f in glob.glob(sys.argv[1] + "/ab_*.jsonl"):
    for l in open(f):
        r = json.loads(l); t[(r["S"], r["causal"], r["impl"], r["tag"])].append(r["ms"])
for k in sorted(t):
    print(k, f"{st.median(t[k]):.3f}", len(t[k]))
P
