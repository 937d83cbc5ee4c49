#!/usr/bin/env bash
# One nvidia-h200 call on the build of branch exp/bwd-fixed-dq (B: wheel + gpu_main + COMMIT):
# the fixed-point deterministic dQ's own test (fallbacks), `bench fwdbwd` (d128, default and
# deterministic=True in turns with SDPA cuDNN / flash), the same at 8K / 16K with the pass
# (CUBEATTN_BWD_DQ_FIXED=0) as the control, then the Rust backward suites and memcheck.
set -u
export CUDA_PATH=/usr/local/cuda
B=.carry/s53f; N=bench/results/h200-2026-12-01-fixed-dq
export CUBEATTN_COMMIT=$(cat $B/COMMIT 2>/dev/null || echo unknown)
L=$OUT/logs; mkdir -p $L
python3 -m pip install -q --no-deps --target /tmp/pyx $B/cubeattn-*.whl > $L/pip.log 2>&1
export PYTHONPATH=/tmp/pyx
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
pack() { tar czf $OUT/run.tgz -C $OUT logs; }
rt() { timeout $1 $B/gpu_main --include-ignored --test-threads 1 --nocapture $2 > $L/$3.log 2>&1; echo "$3 rc=$? ($(el) s)" >> $L/summary.txt; grep -E "FAIL|panicked|test result|ERROR|pass's|identical over" $L/$3.log | head -20 >> $L/summary.txt; pack; }
rt 90 gpu::backward::fixed_point_dq rust_fixed
timeout 200 python3 -m cubeattn.bench fwdbwd --device cuda --config llama3-8b --dense-only --iterations 20 --json $L/fwdbwd.json > $L/fwdbwd.txt 2>&1
echo "fwdbwd rc=$? ($(el) s)" >> $L/summary.txt; pack
CUBEATTN_BWD_DQ_FIXED=0 timeout 80 python3 -m cubeattn.bench fwdbwd --device cuda --config llama3-8b --dense-only --seqlens 8192 16384 --iterations 20 --json $L/fwdbwd_pass.json > $L/fwdbwd_pass.txt 2>&1
echo "fwdbwd (pass) rc=$? ($(el) s)" >> $L/summary.txt; pack
rt 60 gpu::backward::backward_is_deterministic rust_det
timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 python3 $N/san_bwd.py > $L/san_memcheck.log 2>&1
echo "memcheck rc=$? ($(el) s): $(grep -E 'ERROR SUMMARY|rel_l2' $L/san_memcheck.log | tr '\n' ' ')" >> $L/summary.txt; pack
rt $(( 540 - $(el) )) gpu::backward::backward_ rust_bwd
cat $L/summary.txt
python3 - $L/fwdbwd.json $L/fwdbwd_pass.json <<'P'
import json, sys
for f in sys.argv[1:]:
    try:
        rows = json.load(open(f))["rows"]
    except Exception as e:
        print(f, e); continue
    t = {}
    for r in rows:
        if "ms" in r: t.setdefault((r["D"], r["causal"], r["S"]), {})[r["impl"]] = r["ms"]
    print(f.split("/")[-1])
    for k in sorted(t):
        v = t[k]; d = v.get("cubeattn_deterministic"); c = v.get("cubeattn")
        print(k, " ".join(f"{i}={m:.3f}" for i, m in sorted(v.items())), f"det/def={d / c:.3f}" if d and c else "", f"def/cudnn={c / v['sdpa_cudnn']:.3f}" if c and "sdpa_cudnn" in v else "")
P
