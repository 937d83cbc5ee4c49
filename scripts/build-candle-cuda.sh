#!/usr/bin/env bash
# Builds `--features candle-cuda` (cubeattn's candle ops on candle's CUDA tensors) on a machine
# without a GPU, and without the CUDA toolkit, for a GPU box without Rust:
#
#   scripts/build-candle-cuda.sh [DIR]      (default DIR: .carry/candle, git-ignored)
#
# DIR then holds the test binary `candle_gpu` (tests/candle_gpu.rs), the examples
# `candle_cuda_block` and `candle_cuda_bench`, and NEEDED.txt (the shared libraries they load).
# On the GPU box (CUDA 13.0 libraries under $CUDA_PATH, default /usr/local/cuda):
#   CUBEATTN_CANDLE_DIR=DIR scripts/gpu-test.sh test candle
#   CUBEATTN_CANDLE_DIR=DIR scripts/gpu-test.sh benchmark candle
#
#   eval "$(scripts/build-candle-cuda.sh --env)"   sets up the same toolchain in this shell (then
#                                                    `cargo check/test --features candle-cuda` work)
#
# Why a toolchain: candle-core's `cuda` feature compiles candle-kernels with nvcc, and it turns on
# cudarc's `dynamic-linking`, so the CUDA libraries (driver, nvrtc, cublas, cublasLt, curand,
# cudart) must be there at link time. Where $CUDA_HOME (or /usr/local/cuda) has bin/nvcc, that
# toolkit is used. Otherwise the pinned PyPI wheels of requirements-candle-cuda.txt (nvcc, its
# headers, the libraries; CUDA 13.0, what driver 580 runs) are installed with pip into
# $CUBEATTN_CUDA_WHEELS (default target/cuda-wheels), and, since no wheel ships the driver, a
# link-time stand-in libcuda.so (soname libcuda.so.1: the GPU box's driver is what loads) is
# generated from the driver symbols cudarc declares. Kernels are built for CUDA_COMPUTE_CAP
# (default 90: H100 / H200). The default and `cuda` builds (and the wheel) are not affected: they
# load the CUDA libraries at run time.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
FEATURES=candle-cuda

fail() { echo "error: $*" >&2; exit 1; }
note() { echo "[build-candle-cuda] $*" >&2; }

# The unversioned names the linker looks for (-lcublas -> libcublas.so), next to the wheels' .so.N.
link_names() {
  local lib=$1 f base
  for f in "$lib"/lib*.so.*; do
    [ -e "$f" ] || continue
    base=$(basename "$f")
    base=${base%%.so.*}.so
    [ -e "$lib/$base" ] || ln -s "$(basename "$f")" "$lib/$base"
  done
}

# A link-time stand-in for a library no wheel ships: every entry point cudarc declares for it
# (in its bindings SYS, under src/ of the cudarc crate), as an empty function, with the real
# library's soname (which is what the binaries then load).
#   link_stub OUT SONAME SYS
link_stub() {
  local out=$1 soname=$2 sys manifest
  manifest=$(cargo metadata --format-version 1 --features "$FEATURES" 2>/dev/null | "$PY" -c "
import json, sys
for p in json.load(sys.stdin)['packages']:
    if p['name'] == 'cudarc':
        print(p['manifest_path'])" | head -1)
  [ -n "$manifest" ] || fail "cargo metadata found no cudarc package"
  sys=$(dirname "$manifest")/src/$3
  [ -f "$sys" ] || fail "cudarc's bindings not found at $sys"
  mkdir -p "$(dirname "$out")"
  grep -oE 'load::<_F>\("[A-Za-z0-9_]+"\)' "$sys" | sed -E 's/.*"([A-Za-z0-9_]+)".*/void \1(void) {}/' | sort -u > "$out.c"
  [ -s "$out.c" ] || fail "no entry points found in $sys"
  cc -shared -fPIC -Wl,-soname,"$soname" -o "$out" "$out.c"
}

setup_cuda() {
  local home=${CUDA_HOME:-/usr/local/cuda}
  if [ -x "$home/bin/nvcc" ]; then
    note "using the CUDA toolkit at $home"
    export CUDA_HOME=$home
  else
    local wheels=${CUBEATTN_CUDA_WHEELS:-$ROOT/target/cuda-wheels}
    local stamp="$wheels/.requirements"
    if ! cmp -s "$ROOT/requirements-candle-cuda.txt" "$stamp" 2>/dev/null; then
      note "installing the CUDA 13.0 wheels of requirements-candle-cuda.txt into $wheels (about 700 MB)"
      "$PY" -m pip install -q --disable-pip-version-check --no-deps --upgrade --target "$wheels" \
        -r "$ROOT/requirements-candle-cuda.txt" || fail "pip could not install requirements-candle-cuda.txt"
      cp "$ROOT/requirements-candle-cuda.txt" "$stamp"
    fi
    export CUDA_HOME=$wheels/nvidia/cu13
    [ -x "$CUDA_HOME/bin/nvcc" ] || fail "no nvcc at $CUDA_HOME/bin after installing the wheels"
    # nvcc.profile runs cicc from nvvm/bin; the nvvm wheel ships it in bin/
    if [ ! -e "$CUDA_HOME/nvvm/bin/cicc" ] && [ -x "$CUDA_HOME/bin/cicc" ]; then
      mkdir -p "$CUDA_HOME/nvvm/bin" && ln -s ../../bin/cicc "$CUDA_HOME/nvvm/bin/cicc"
    fi
    link_names "$CUDA_HOME/lib"
    [ -e "$CUDA_HOME/lib/stubs/libcuda.so" ] || link_stub "$CUDA_HOME/lib/stubs/libcuda.so" libcuda.so.1 driver/sys/mod.rs
  fi
  # NCCL (cudarc's `nccl`, turned on by cubecl-cuda) is linked too but is in no toolkit; nothing
  # here calls it, so the linker drops it again (--as-needed): a stand-in is enough to link. It
  # goes on LIBRARY_PATH (the C compiler that links reads it; RUSTFLAGS would rebuild everything).
  if ! ls "$CUDA_HOME"/lib*/libnccl.so >/dev/null 2>&1; then
    local stubs=${CUBEATTN_CUDA_WHEELS:-$ROOT/target/cuda-wheels}/link-stubs
    [ -e "$stubs/libnccl.so" ] || link_stub "$stubs/libnccl.so" libnccl.so.2 nccl/sys/mod.rs
    export LIBRARY_PATH=$stubs${LIBRARY_PATH:+:$LIBRARY_PATH}
  fi
  export PATH=$CUDA_HOME/bin:$PATH
  export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
  # cudarc's bindings for CUDA 13.0 (also set in .cargo/config.toml)
  export CUDARC_CUDA_VERSION=${CUDARC_CUDA_VERSION:-13000}
}

if [ "${1:-}" = --env ]; then
  setup_cuda
  printf 'export CUDA_HOME=%q PATH=%q CUDA_COMPUTE_CAP=%q CUDARC_CUDA_VERSION=%q LIBRARY_PATH=%q\n' \
    "$CUDA_HOME" "$PATH" "$CUDA_COMPUTE_CAP" "$CUDARC_CUDA_VERSION" "${LIBRARY_PATH:-}"
  exit 0
fi

OUTDIR=${1:-$ROOT/.carry/candle}
command -v cargo >/dev/null 2>&1 || fail "cargo not found"
command -v cc >/dev/null 2>&1 || fail "a C compiler (cc) is needed: nvcc's host compiler and the driver stub"
setup_cuda
mkdir -p "$OUTDIR"

# the executable a cargo build with --message-format=json reports for target NAME
artifact() {
  "$PY" -c "import sys, json
name = sys.argv[1]
for l in sys.stdin:
    m = json.loads(l) if l.startswith('{') else {}
    if m.get('reason') == 'compiler-artifact' and m['target']['name'] == name and m.get('executable'):
        print(m['executable'])" "$1" | tail -1
}

note "cargo test --release --features $FEATURES --test candle_gpu --no-run (candle-kernels' nvcc build takes a while)"
json=$(cargo test --release --features "$FEATURES" --test candle_gpu --no-run --message-format=json) \
  || fail "the candle_gpu test binary did not build (run the cargo command by hand to see why)"
bin=$(echo "$json" | artifact candle_gpu)
[ -n "$bin" ] || fail "cargo reported no candle_gpu executable"
cp "$bin" "$OUTDIR/candle_gpu"

note "cargo build --release --features $FEATURES --example candle_cuda_block --example candle_cuda_bench"
json=$(cargo build --release --features "$FEATURES" --example candle_cuda_block --example candle_cuda_bench --message-format=json) \
  || fail "the candle CUDA examples did not build"
for ex in candle_cuda_block candle_cuda_bench; do
  exe=$(echo "$json" | artifact "$ex")
  [ -n "$exe" ] || fail "cargo reported no $ex executable"
  cp "$exe" "$OUTDIR/$ex"
done
strip "$OUTDIR"/candle_gpu "$OUTDIR"/candle_cuda_block "$OUTDIR"/candle_cuda_bench 2>/dev/null || true
git -C "$ROOT" rev-parse --short HEAD > "$OUTDIR/COMMIT" 2>/dev/null || true
{
  echo "# shared libraries the binaries load (readelf -d NEEDED); the GPU box must have them"
  for f in candle_gpu candle_cuda_block candle_cuda_bench; do
    echo "$f: $(readelf -d "$OUTDIR/$f" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p' | tr '\n' ' ')"
  done
} > "$OUTDIR/NEEDED.txt"
cat "$OUTDIR/NEEDED.txt"
ls -la "$OUTDIR"
