#!/usr/bin/env bash
# Second call: the four failures of main-checks' run2 (positions 456-463 of its order: the
# in-place-read test, non-causal, 16-bit, w = 1 / 3, head_dim 128). Hypothesis: the ordered call
# takes 160-key tiles (not paged) and the paged in-place read 128, so out / lse differ in the last
# bits. Checked: the old exact comparison with the default tiles (fails) and with
# CUBEATTN_CUDA_WS_BN=128 (passes); the test with the frame's rule; then test_sparse_gpu.py whole.
set -u
cd "$(dirname "$0")/../../.."
B=.carry/m61
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} CUBEATTN_REQUIRE_GPU=1
export CUBEATTN_COMMIT=$(cat $B/COMMIT) CUBEATTN_CACHE_DIR=$(mktemp -d)
PYX=$(mktemp -d); timeout 120 python3 -m pip install -q --no-deps --target $PYX $B/cubeattn-*.whl > /dev/null 2>&1
export PYTHONPATH=$PYX:tests/python
L=$(mktemp -d)/logs; mkdir -p $L
pack() { tar -C $(dirname $L) -czf $OUT/logs.tgz logs; }
T=tests/python
exact() { timeout 90 python3 -c "
from test_zigzag import check_in_place_read
for w, dt in ((1, 'bfloat16'), (3, 'float16')):
    m = 2 * w * 64
    try:
        check_in_place_read(w, [3 * m, m, 0], dt, False, 'cuda', stride_heads=(8, 2), d=128, seed=w)
        print('w', w, dt, 'bit for bit')
    except AssertionError as e:
        print('w', w, dt, 'differs')
" 2>&1 | tail -3; }
echo "== exact, default tiles"; exact | tee $L/exact_default.txt
echo "== exact, CUBEATTN_CUDA_WS_BN=128"; CUBEATTN_CUDA_WS_BN=128 exact | tee $L/exact_bn128.txt
echo "== in-place read tests"
timeout 150 python3 -m pytest -q -rf --tb=short -m "gpu or torch" -p no:cacheprovider $T/test_zigzag_gpu.py -k in_place_read > $L/inplace.txt 2>&1
grep -E "^FAILED|^E |passed|failed" $L/inplace.txt | head -10; pack
echo "== test_sparse_gpu.py"
timeout 300 python3 -m pytest -v -rf --tb=short -m "gpu or torch" -p no:cacheprovider $T/test_sparse_gpu.py > $L/sparse.txt 2>&1; echo "rc=$?"
echo "$(grep -c ' PASSED' $L/sparse.txt) passed, $(grep -c ' FAILED' $L/sparse.txt) failed"; grep -E " FAILED|^E " $L/sparse.txt | head -8; tail -1 $L/sparse.txt
pack
