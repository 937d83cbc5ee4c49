#!/usr/bin/env bash
# One nvidia-h200 call on main's build with 160-key tiles (BUILD_DIR): ncu with source counters of
# the non-causal d128 8K forward (`flash_fwd_ws`, 160 keys) for the stall lines, then the pytest
# GPU files whose calls take the non-causal d128 forward (torch, properties, callpath, kvcache,
# nonfinite, lse_split, compile), each with its own time limit.
set -u
export CUDA_PATH=/usr/local/cuda CUBEATTN_COMMIT=${COMMIT:-unknown}
B=BUILD_DIR; N=bench/results/h200-2026-12-01-main-sweep; F=bench/results/h200-2026-12-01-fwd-ncu
L=$OUT/logs; mkdir -p $L
python3 -m pip install -q --no-deps --target /tmp/pyx $B/cubeattn-*.whl > $L/pip.log 2>&1
export PYTHONPATH=/tmp/pyx
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
pack() { tar czf $OUT/run.tgz -C $OUT logs; }
IMPL=ours S=8192 timeout 120 ncu --clock-control none --set full --import-source no -k regex:flash_fwd_ws --launch-skip 2 --launch-count 1 \
  -o /tmp/f160 python3 $F/fwd_step.py > $L/ncu.log 2>&1
ncu --import /tmp/f160.ncu-rep --page details > $L/ours160_d128_nc8192_details.txt 2>&1
ncu --import /tmp/f160.ncu-rep --page source --csv --print-source sass > /tmp/source160.csv 2>/dev/null
python3 $N/stall_lines.py /tmp/source160.csv 60 > $L/stall_lines_nc8k.txt 2>&1
echo "ncu ($(el) s)" >> $L/summary.txt; pack
for f in test_torch test_callpath test_kvcache_gpu test_nonfinite test_lse_split test_compile_gpu test_properties_gpu; do
  left=$(( 400 - $(el) )); [ $left -lt 20 ] && { echo "SKIPPED (time) $f" >> $L/summary.txt; continue; }
  timeout $left python3 -m pytest -q -m "gpu or torch" tests/python/$f.py -p no:cacheprovider > $L/$f.log 2>&1
  echo "$f: rc=$? ($(el) s) $(tail -1 $L/$f.log)" >> $L/summary.txt; pack
done
cat $L/summary.txt
grep -E "Duration|SM Frequency|Issue Slots Busy|No Eligible|Executed Instructions |Registers Per|Dynamic Shared" $L/ours160_d128_nc8192_details.txt | head -12
head -40 $L/stall_lines_nc8k.txt | cut -c1-170
tail -1 $L/stall_lines_nc8k.txt
