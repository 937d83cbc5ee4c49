#!/usr/bin/env bash
# session 51, call 3 (one H200), main's build (3f27862): ncu of the d128 forward kernels (ours
# `flash_fwd_ws`, cuDNN's fprop) at non-causal 4K and 8K; then `bench fwdbwd --dense-only`
set -u
export CUDA_PATH=/usr/local/cuda
B=BUILD_DIR; N=bench/results/h200-2026-12-01-fwd-ncu
L=$OUT/logs; mkdir -p $L
python3 -m pip install -q --no-deps --target /tmp/pyx $B/cubeattn-*.whl > $L/pip.log 2>&1
export PYTHONPATH=/tmp/pyx
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
for S in 8192 4096; do
  for impl in ours cudnn; do
    k=$([ $impl = ours ] && echo flash_fwd_ws || echo fprop)
    IMPL=$impl S=$S timeout 100 ncu --clock-control none --set full --import-source no -k regex:$k --launch-skip 2 --launch-count 1 \
      -o /tmp/f_${impl}_$S python3 $N/fwd_step.py > $L/ncu_${impl}_$S.log 2>&1
    ncu --import /tmp/f_${impl}_$S.ncu-rep --page details > $L/${impl}_d128_nc${S}_details.txt 2>&1
    [ $S = 8192 ] && ncu --import /tmp/f_${impl}_$S.ncu-rep --page source --csv --print-source sass > /tmp/source_$impl.csv 2>/dev/null
    echo "ncu $impl $S ($(el) s)" >> $L/summary.txt
  done
done
(cd /tmp && python3 $OLDPWD/bench/results/h200-2026-11-30-bwd-ncu/stalls_ops.py ours cudnn) > $L/stalls_ops_nc8k.txt 2>&1
timeout $(( 560 - $(el) )) python3 -m cubeattn.bench fwdbwd --dense-only --iterations 20 --json $L/fwdbwd.json > $L/fwdbwd_log.txt 2>&1
echo "fwdbwd rc=$? ($(el) s)" >> $L/summary.txt
tar czf $OUT/run.tgz -C $OUT logs
cat $L/summary.txt
for f in $L/*_details.txt; do echo "== $f"; grep -E "Duration|SM Frequency|Issue Slots Busy|No Eligible|Tensor|Executed Instructions |Warp Cycles Per Issued|Registers Per" $f | head -14; done
head -12 $L/stalls_ops_nc8k.txt | cut -c1-400
tail -22 $L/fwdbwd_log.txt
