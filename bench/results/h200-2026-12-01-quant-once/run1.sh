#!/usr/bin/env bash
# Prepared for the next GPU call (not yet run): branch exp/quant-rows-once, its build B (wheel +
# gpu_main + COMMIT) against M, the build of the branch's base (.carry/s53g, 637fc74: its src/ and
# python/ are 56d5255's; .carry/s52x predates the FP8 P.V fix, whose unwritten V^T bytes would
# make the byte comparison differ for another reason). int8_quantize reads each row once
# (registers, group maxima in shared memory). (a) the Rust INT8 / FP8 GPU suites on B (`int8`:
# sparse_int8_* against the CPU emulation and the exact path, nonfinite's INT8 + FP8 flag test),
# and same_out.py under B and M: INT8 / FP8 outputs and LSEs must be the same bytes (the pass is
# meant to be bit-exact with the old one); (b) pytest -m "gpu or torch" test_sage.py,
# test_sparse_fp8.py and test_sparse_gpu.py's INT8 tests on B; (c) prof_quant.py in alternating
# processes (B M M B): int8_quantize's time per launch (torch.profiler, Q and K apart) and the
# sage FP8 / INT8 calls in turns, B4 H32 d128 8K / 16K; (d) compute-sanitizer memcheck and
# racecheck of san_quant.py on B. One nvidia-h200 call, about 4 to 5 minutes (M's kernels compile
# cold in (a)).
set -u
export CUDA_PATH=/usr/local/cuda
B=.carry/s53q; M=.carry/s53g; N=bench/results/h200-2026-12-01-quant-once
export CUBEATTN_COMMIT=$(cat $B/COMMIT 2>/dev/null || echo unknown)
L=$OUT/logs; mkdir -p $L
PYB=$(mktemp -d); PYM=$(mktemp -d)
timeout 60 python3 -m pip install -q --no-deps --target $PYB $B/cubeattn-*.whl > $L/pip.log 2>&1
timeout 60 python3 -m pip install -q --no-deps --target $PYM $M/cubeattn-*.whl >> $L/pip.log 2>&1
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
# the call's time (TOTAL, default 540 s) and when stage (c) stops starting runs (C_UNTIL, 400 s);
# the recorded run used TOTAL=270 C_UNTIL=190 to fit the session's device time
TOTAL=${TOTAL:-540}; C_UNTIL=${C_UNTIL:-400}
# a step's timeout: its cap, or what is left of TOTAL
cap() { local left=$(( TOTAL - $(el) )); [ $left -lt $1 ] && echo $(( left > 5 ? left : 5 )) || echo $1; }
pack() { tar czf $OUT/run.tgz -C $OUT logs; }
timeout 20 nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv > $L/gpu.txt 2>&1
# (a)
timeout $(cap 150) $B/gpu_main --include-ignored --test-threads 1 --nocapture int8 > $L/rust_int8.log 2>&1
echo "(a) rust int8 rc=$? ($(el) s): $(grep 'test result' $L/rust_int8.log | tr '\n' ' ')" >> $L/summary.txt
grep -E "FAIL|panicked" $L/rust_int8.log | head -20 >> $L/summary.txt; pack
PYTHONPATH=$PYB timeout $(cap 60) python3 $N/same_out.py run $L/same_B.npz > $L/same_B.txt 2>&1
echo "(a) same_out B rc=$? ($(el) s): $(tail -1 $L/same_B.txt)" >> $L/summary.txt; pack
PYTHONPATH=$PYM timeout $(cap 100) python3 $N/same_out.py run $L/same_M.npz > $L/same_M.txt 2>&1
echo "(a) same_out M rc=$? ($(el) s): $(tail -1 $L/same_M.txt)" >> $L/summary.txt
timeout 30 python3 $N/same_out.py compare $L/same_B.npz $L/same_M.npz > $L/same_compare.txt 2>&1
echo "(a) B vs M bytes rc=$?: $(tail -1 $L/same_compare.txt)" >> $L/summary.txt
grep -v "^compare" $L/same_compare.txt | head -10 >> $L/summary.txt; rm -f $L/same_B.npz $L/same_M.npz; pack
# (b)
PYTHONPATH=$PYB timeout $(cap 90) python3 -m pytest -q -m "gpu or torch" tests/python/test_sage.py tests/python/test_sparse_fp8.py -p no:cacheprovider -rf > $L/pytest_sage_fp8.log 2>&1
echo "(b) pytest sage + sparse_fp8 rc=$? ($(el) s): $(tail -1 $L/pytest_sage_fp8.log)" >> $L/summary.txt; pack
PYTHONPATH=$PYB timeout $(cap 90) python3 -m pytest -q -m "gpu or torch" tests/python/test_sparse_gpu.py -k int8 -p no:cacheprovider -rf > $L/pytest_sparse_gpu_int8.log 2>&1
echo "(b) pytest sparse_gpu -k int8 rc=$? ($(el) s): $(tail -1 $L/pytest_sparse_gpu_int8.log)" >> $L/summary.txt; pack
# (c)
r=0
for b in B M M B; do
  r=$((r + 1)); py=$PYB; [ $b = M ] && py=$PYM
  if [ $(el) -gt $C_UNTIL ]; then echo "(c) run $r ($b) skipped ($(el) s)" >> $L/summary.txt; continue; fi
  p=""; [ $r -le 2 ] && p=--profile
  PYTHONPATH=$py timeout $(cap 60) python3 $N/prof_quant.py $b $p 10 > $L/ab_${b}_$r.jsonl 2> $L/ab_${b}_$r.err
  echo "(c) prof_quant $b run $r rc=$? ($(el) s)" >> $L/summary.txt; pack
done
# (d)
PYTHONPATH=$PYB timeout $(cap 60) compute-sanitizer --tool memcheck --error-exitcode 9 python3 $N/san_quant.py > $L/san_memcheck.log 2>&1
echo "(d) memcheck rc=$? ($(el) s): $(grep -E 'ERROR SUMMARY|worst' $L/san_memcheck.log | tr '\n' ' ')" >> $L/summary.txt; pack
PYTHONPATH=$PYB timeout $(cap 90) compute-sanitizer --tool racecheck --error-exitcode 9 python3 $N/san_quant.py > $L/san_racecheck.log 2>&1
echo "(d) racecheck rc=$? ($(el) s): $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY|worst' $L/san_racecheck.log | tr '\n' ' ')" >> $L/summary.txt; pack
# summary: int8_quantize per launch and the calls' medians per build
python3 - $L > $L/table.txt 2>&1 <<'P'
import json, sys, glob, statistics as st, collections
prof, ms = collections.defaultdict(list), collections.defaultdict(list)
for f in sorted(glob.glob(sys.argv[1] + "/ab_*.jsonl")):
    for l in open(f):
        try:
            r = json.loads(l)
        except ValueError:
            continue
        if r.get("profile"):
            if "int8_quantize" in r["kernel"] or "chunk_stats" in r["kernel"] or "fp8_v" in r["kernel"]:
                prof[(r["S"], r["impl"], r["kernel"])].append((r["tag"], r["us_per_launch"]))
        else:
            ms[(r["S"], r["causal"], r["impl"], r["tag"])].append(r["ms"])
print("kernel us per launch (profile, non-causal, 5 calls): S impl kernel: B / M")
for k in sorted(prof):
    d = dict(prof[k])
    print(" ", *k, ":", " / ".join(f"{d[t]:.1f}" if t in d else "-" for t in ("B", "M")))
print("call ms (median of the runs' medians): S causal impl: B / M  B/M")
for k in sorted({k[:3] for k in ms}):
    b, m = (st.median(ms[k + (t,)]) if ms.get(k + (t,)) else float("nan") for t in ("B", "M"))
    print(" ", *k, f": {b:.3f} / {m:.3f}  {b / m:.4f}")
P
pack
cat $L/summary.txt $L/table.txt
