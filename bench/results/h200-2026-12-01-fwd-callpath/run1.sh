#!/usr/bin/env bash
# One nvidia-h200 call on main's build (BUILD_DIR: wheel of 3f27862, whose kernels main still has)
# with main's bench.py over it: the forward call-path profile, then the official `bench dense`
# (d128 / d64, causal and not) and `bench fwdbwd --dense-only`, torch calls timed in turns.
set -u
export CUDA_PATH=/usr/local/cuda
B=BUILD_DIR; N=bench/results/h200-2026-12-01-fwd-callpath
L=$OUT/logs; mkdir -p $L
python3 -m pip install -q --no-deps --target /tmp/pyx $B/cubeattn-*.whl > $L/pip.log 2>&1
cp python/cubeattn/bench.py /tmp/pyx/cubeattn/bench.py
export PYTHONPATH=/tmp/pyx
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
pack() { tar czf $OUT/run.tgz -C $OUT logs; }
timeout 120 python3 $N/fwd_callpath.py > $L/fwd_callpath.txt 2>&1; echo "callpath rc=$? ($(el) s)" >> $L/summary.txt; pack
for c in llama3-8b gqa-d64; do for m in --causal --no-causal; do
  timeout 90 python3 -m cubeattn.bench dense --device cuda --config $c $m --iterations 20 --json $L/dense_${c}${m}.json > $L/dense_${c}${m}.txt 2>&1
  echo "dense $c $m rc=$? ($(el) s)" >> $L/summary.txt; pack
done; done
timeout $(( 560 - $(el) )) python3 -m cubeattn.bench fwdbwd --device cuda --dense-only --iterations 20 --json $L/fwdbwd.json > $L/fwdbwd.txt 2>&1
echo "fwdbwd rc=$? ($(el) s)" >> $L/summary.txt; pack
cat $L/summary.txt; grep -E "^==" $L/fwd_callpath.txt
