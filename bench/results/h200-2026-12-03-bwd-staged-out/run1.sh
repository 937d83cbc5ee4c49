#!/usr/bin/env bash
# dK / dV out through shared memory (build .carry/bso, 7e8467f) against the build before it
# (.carry/fin, 6dc76da): `bench fwdbwd --dense-only` in alternating processes (two rounds, SDPA
# cuDNN in each), then on the new build the Rust backward suite (f64 reference and CPU, both dQ
# paths; determinism) and memcheck / racecheck of the two backward families.
set -u
cd "$(dirname "$0")/../../.."
R=bench/results/h200-2026-12-03-bwd-staged-out
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} CUBEATTN_REQUIRE_GPU=1
declare -A PY CM
for x in fin bso; do
  PY[$x]=$(mktemp -d); timeout 120 python3 -m pip install -q --no-deps --target ${PY[$x]} .carry/$x/cubeattn-*.whl > /dev/null 2>&1
  CM[$x]=$(cat .carry/$x/COMMIT)
done
export CUBEATTN_CACHE_DIR=$(mktemp -d)
L=$(mktemp -d)/logs; mkdir -p $L
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
pack() { tar -C $(dirname $L) -czf $OUT/logs.tgz logs; }
step() { local n=$1; shift; local s=$(date +%s); timeout ${TMO:-120} "$@" > $L/$n.txt 2>&1; local rc=$?; echo "$n rc=$rc $(( $(date +%s)-s ))s (at $(el) s)" | tee -a $L/summary.txt; pack; }
timeout 20 nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv > $L/gpu.txt 2>&1
BENCH="python3 -c 'import sys, cubeattn.bench as b; sys.exit(b.main(sys.argv[1:]))'"
for r in 1 2; do
  case $r in 2) order="bso fin" ;; *) order="fin bso" ;; esac
  for x in $order; do
    PYTHONPATH=${PY[$x]} CUBEATTN_COMMIT=${CM[$x]} TMO=70 step c_${x}_r$r bash -c "$BENCH fwdbwd --config llama3-8b --causal --dense-only --seqlens 4096 8192 16384 --json $L/c_${x}_r$r.json"
    PYTHONPATH=${PY[$x]} CUBEATTN_COMMIT=${CM[$x]} TMO=40 step n_${x}_r$r bash -c "$BENCH fwdbwd --config llama3-8b --no-causal --dense-only --seqlens 8192 --json $L/n_${x}_r$r.json"
    PYTHONPATH=${PY[$x]} CUBEATTN_COMMIT=${CM[$x]} TMO=40 step m_${x}_r$r bash -c "$BENCH fwdbwd --config mha-d128 --causal --dense-only --seqlens 8192 --json $L/m_${x}_r$r.json"
  done
done
python3 $R/table.py $L/[cnm]_*.json > $L/table.md 2>&1; pack
cat $L/table.md
TMO=${RUST_TMO:-170} step rust_bwd .carry/bso/gpu_main --include-ignored --test-threads 1 gpu::backward::backward_matches_f64_reference_and_cpu gpu::backward::backward_is_deterministic
export PYTHONPATH=${PY[bso]} CUBEATTN_WHEEL=$(ls .carry/bso/cubeattn-*.whl)
CUBEATTN_SAN_TOOLS="memcheck racecheck" CUBEATTN_SAN_FAMILIES="backward_pass backward_atomic" TMO=${SAN_TMO:-120} step sanitize scripts/gpu-test.sh sanitize
pack
cat $L/summary.txt
grep -hE "test result|FAIL|panicked" $L/rust_bwd.txt | head -8 | cut -c1-200
grep -E "exit" $L/sanitize.txt
