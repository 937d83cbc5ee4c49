#!/usr/bin/env bash
# ncu with source counters on the FP8 sage kernel (`flash_fwd_sm90`, INT8 Q K^T + FP8 P.V) of
# main's build (BUILD, default .carry/s54m), B4 H32 d128 8K non-causal, the third call's launch:
# where its warps stall, by SASS line (../h200-2026-12-01-main-sweep/stall_lines.py) and the
# details page. One nvidia-h200 call, about 2 minutes.
set -u
export CUDA_PATH=/usr/local/cuda
B=${BUILD:-.carry/s54m}; N=bench/results/h200-2026-12-01-fp8-ncu; W=bench/results/h200-2026-12-01-main-sweep
L=$OUT/logs; mkdir -p $L
python3 -m pip install -q --no-deps --target /tmp/pyx $B/cubeattn-*.whl > $L/pip.log 2>&1
export PYTHONPATH=/tmp/pyx
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
python3 $N/sage_step.py > $L/warm.log 2>&1  # kernels compiled into the disk cache before ncu
timeout 240 ncu --clock-control none --set full --import-source no -k regex:flash_fwd_sm90 --launch-skip 2 --launch-count 1 \
  -o /tmp/fp8 python3 $N/sage_step.py > $L/ncu.log 2>&1
echo "ncu rc=$? ($(el) s)" >> $L/summary.txt
ncu --import /tmp/fp8.ncu-rep --page details > $L/fp8_nc8192_details.txt 2>&1
ncu --import /tmp/fp8.ncu-rep --page source --csv --print-source sass > /tmp/source.csv 2>/dev/null
python3 $W/stall_lines.py /tmp/source.csv 70 > $L/stall_lines_nc8k.txt 2>&1
cp /tmp/source.csv $L/source_nc8k.csv 2>/dev/null; gzip -f $L/source_nc8k.csv
tar czf $OUT/run.tgz -C $OUT logs
cat $L/summary.txt
grep -E "Duration|SM Frequency|Issue Slots Busy|No Eligible|Executed Instructions |Registers Per|Dynamic Shared|Warp Cycles Per Issued|Achieved Occupancy" $L/fp8_nc8192_details.txt | head -14
head -50 $L/stall_lines_nc8k.txt | cut -c1-170
tail -1 $L/stall_lines_nc8k.txt
