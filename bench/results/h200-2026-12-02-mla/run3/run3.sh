#!/usr/bin/env bash
D=$(cd "$(dirname "$0")" && pwd)
cd "$(dirname "$0")/../.."
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda}
T=$(mktemp -d); pip install -q --no-deps --target $T $D/cubeattn-*.whl >/dev/null 2>&1; export PYTHONPATH=$T
L=$(mktemp -d)/logs; mkdir -p $L
trap 'tar -C $(dirname $L) -czf $OUT/logs.tgz logs' EXIT
timeout 400 python $D/d32.py $L/d32.json $(cat $D/COMMIT) 2>&1 | grep -v Warning | tee $L/d32.txt
