#!/usr/bin/env bash
# The whole test suite: Rust unit + integration tests (GPU tests skip, printing why, without a GPU),
# then the wheel is built and installed into the virtual environment and pytest runs (with torch,
# from requirements-torch.txt, unless CUBEATTN_TORCH=0).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
setup_venv
setup_torch
# `candle` (the candle-core ops and tests/candle.rs) joins the tested features: one build for both
feat=(--features "${FEATURES:+$FEATURES,}candle")
echo "== cargo test --release ${feat[*]}"
cargo test --release "${feat[@]}"
echo "== wheel (features: python ${FEATURES})"
build_wheel
echo "== pytest"
cd "$ROOT/tests/python"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider
