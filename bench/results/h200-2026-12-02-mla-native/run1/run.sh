#!/usr/bin/env bash
# device run: flash_fwd_ws with v at its own head_dim (MLA 192 / 128), tests, ptxas, bench
D=$(cd "$(dirname "$0")" && pwd)
cd "$(dirname "$0")/../.."
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} CUBEATTN_REQUIRE_GPU=1 CUBEATTN_COMMIT=$(cat $D/COMMIT)
T=$(mktemp -d); pip install -q --no-deps --target $T $D/cubeattn-*.whl >/dev/null 2>&1; export PYTHONPATH=$T
L=$(mktemp -d)/logs; mkdir -p $L
trap 'tar -C $(dirname $L) -czf $OUT/logs.tgz logs' EXIT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $L/gpu.txt
step() { local n=$1; shift; local t0=$(date +%s); timeout ${TMO:-200} "$@" > $L/$n.txt 2>&1; local rc=$?; echo "$n rc=$rc $(( $(date +%s)-t0 ))s" | tee -a $L/summary.txt; }
B="python -c 'import sys, cubeattn.bench as b; sys.exit(b.main(sys.argv[1:]))'"
c=mla-d192-v128
export CUBEATTN_CACHE_DIR=$(mktemp -d)
CUBEATTN_DUMP_DIR=$L/dump TMO=150 step bench_dense_$c bash -c "$B dense --config $c --seqlens 8192 16384 --json $L/dense_$c.json"
TMO=60 step bench_dense_nc_$c bash -c "$B dense --config $c --no-causal --seqlens 8192 --json $L/dense_nc_$c.json"
CUBEATTN_CUDA_WS_BN_V=64 TMO=100 step bench_dense_bn64_$c bash -c "$B dense --config $c --seqlens 8192 16384 --json $L/dense_bn64_$c.json"
CUBEATTN_CUDA_WS_BN_V=64 TMO=60 step bench_dense_nc_bn64_$c bash -c "$B dense --config $c --no-causal --seqlens 8192 --json $L/dense_nc_bn64_$c.json"
TMO=150 step bench_fwdbwd_$c bash -c "$B fwdbwd --config $c --dense-only --seqlens 8192 --json $L/fwdbwd_$c.json"
TMO=60 step ptxas bash -c "python3 scripts/kernel_code.py count $L/dump --sass"
TMO=150 step rust $D/gpu_main --include-ignored --test-threads=1 --nocapture value_head_dim
TMO=60 step rust_nonfinite $D/gpu_main --include-ignored --test-threads=1 --nocapture nonfinite
TMO=100 step pytest bash -c "cd tests/python && python -m pytest -q -p no:cacheprovider test_torch.py -k 'head_dim_of_its_own or v_with or v_of_another'"
grep -E "test result" $L/rust*.txt; grep -E " NO |FAIL|ERROR|panicked" $L/rust*.txt | head
tail -n 2 $L/pytest.txt
grep -iE "flash_fwd_ws|spill|C75|warn" $L/ptxas.txt | head -20
cat $L/summary.txt
for f in $L/bench_*.txt; do echo "== $f"; grep -v "^#" $f | grep -v Warn | awk '{print $1,$2,$3,$4,$5,$6,$7,$8}'; done
