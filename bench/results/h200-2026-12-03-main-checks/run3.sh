#!/usr/bin/env bash
# Third call: test_gpu.py's fallback test rewritten (float32 block-sparse: no CUDA kernel), then the
# pytest files run2.sh did not reach in its 420 s, each with its own time limit.
set -u
cd "$(dirname "$0")/../../.."
B=.carry/dqo
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} CUBEATTN_REQUIRE_GPU=1
export CUBEATTN_COMMIT=$(cat $B/COMMIT) CUBEATTN_CACHE_DIR=$(mktemp -d)
PYX=$(mktemp -d); timeout 120 python3 -m pip install -q --no-deps --target $PYX $B/cubeattn-*.whl > /dev/null 2>&1
export PYTHONPATH=$PYX
T=tests/python
timeout 60 python3 -m pytest -q -m "gpu or torch" -p no:cacheprovider $T/test_gpu.py -k "falls_back or memory" 2>&1 | tail -3
for f in test_nonfinite.py test_sparse_gpu.py; do echo "== $f"; timeout 75 python3 -m pytest -q -rf --maxfail 3 -m "gpu or torch" -p no:cacheprovider $T/$f 2>&1 | grep -E "^FAILED|^E  |passed|failed" | head -12; done
