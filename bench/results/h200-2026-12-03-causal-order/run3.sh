#!/usr/bin/env bash
# Third call, on the build of 3a6140b (.carry/co): test_zigzag_gpu.py's in-place-read cases, which
# run2.sh's 60 s cut after 7 (causal grouped d128 calls now go kv head outer on both sides).
set -u
cd "$(dirname "$0")/../../.."
B=.carry/co
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} CUBEATTN_REQUIRE_GPU=1 CUBEATTN_CACHE_DIR=$(mktemp -d)
PYX=$(mktemp -d); timeout 120 python3 -m pip install -q --no-deps --target $PYX $B/cubeattn-*.whl > /dev/null 2>&1
export PYTHONPATH=$PYX
timeout 140 python3 -m pytest -q -rf -m "gpu or torch" -p no:cacheprovider tests/python/test_zigzag_gpu.py -k in_place_read 2>&1 | tail -4
