#!/usr/bin/env bash
# ncu (full set, details page) of the MLA 192/128 backward kernels at 8K: the split dK/dV kernel
# causal and non-causal, the dQ pass causal. Where the causal backward's time goes.
D=$(cd "$(dirname "$0")" && pwd)
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda}
T=$(mktemp -d); pip install -q --no-deps --target $T $D/cubeattn-*.whl >/dev/null 2>&1; export PYTHONPATH=$T
export CUBEATTN_CACHE_DIR=$(mktemp -d)
L=$OUT/logs; mkdir -p $L
python3 $D/mla_step.py > $L/warm.txt 2>&1; CAUSAL=0 python3 $D/mla_step.py >> $L/warm.txt 2>&1; echo "warm $SECONDS s" >> $L/summary.txt
prof() { local n=$1 k=$2 c=$3; CAUSAL=$c timeout 60 ncu --clock-control none --set full --import-source no -k regex:$k --launch-skip 1 --launch-count 1 \
  -o /tmp/$n python3 $D/mla_step.py > $L/ncu_$n.log 2>&1; echo "$n rc=$?" >> $L/summary.txt
  ncu --import /tmp/$n.ncu-rep --page details > $L/$n.txt 2>&1; }
prof split_causal flash_bwd_sm90_split 1
prof split_full flash_bwd_sm90_split 0
cat $L/summary.txt
for f in split_causal split_full; do echo "== $f"; grep -E "Duration|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible|Executed Instructions  |Warp Cycles Per Issued|Achieved Occupancy|Registers Per|Grid Size" $L/$f.txt | head -12; done
