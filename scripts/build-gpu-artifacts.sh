#!/usr/bin/env bash
# Builds, on a machine with cargo (no GPU or CUDA toolkit needed), what a GPU box without cargo
# needs: the wheel (features python,cuda) and the stripped GPU test binary, into DIR.
#   scripts/build-gpu-artifacts.sh DIR
# and DIR/COMMIT, the commit they were built from. Then on the GPU box:
#   CUBEATTN_WHEEL=DIR/cubeattn-*.whl CUBEATTN_TEST_BIN=DIR/gpu_main scripts/gpu-test.sh test
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
OUTDIR=${1:?usage: scripts/build-gpu-artifacts.sh DIR}
mkdir -p "$OUTDIR"
setup_venv
FEATURES=cuda build_wheel
cp "$ROOT"/dist/cubeattn-*.whl "$OUTDIR"/
bin=$(cargo test --release --features cuda --test gpu_main --no-run --message-format=json 2>/dev/null \
  | "$VENV/bin/python" -c "import sys, json
for l in sys.stdin:
    m = json.loads(l)
    if m.get('reason') == 'compiler-artifact' and m['target']['name'] == 'gpu_main' and m.get('executable'):
        print(m['executable'])" | tail -1)
[ -n "$bin" ] || { echo "error: could not build the gpu_main test binary" >&2; exit 1; }
cp "$bin" "$OUTDIR/gpu_main"
strip "$OUTDIR/gpu_main" 2>/dev/null || true
# the commit the artifacts were built from (with -dirty when the sources differ from it): benchmark
# records take it (CUBEATTN_COMMIT) where the GPU box's checkout may be another commit
commit=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
[ -n "$(git -C "$ROOT" status --porcelain -- src python tests Cargo.toml Cargo.lock pyproject.toml 2>/dev/null)" ] && commit="$commit-dirty"
echo "$commit" > "$OUTDIR/COMMIT"
ls -la "$OUTDIR"
