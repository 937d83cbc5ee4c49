# Sourced by the other scripts: a virtual environment with the pinned tools, and the wheel build.
# CUBEATTN_VENV: where the virtual environment lives (default .venv)
# CUBEATTN_FEATURES: cargo features of the wheel besides `python` (default "cuda"; "" for CPU only)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
VENV=${CUBEATTN_VENV:-$ROOT/.venv}
FEATURES=${CUBEATTN_FEATURES-cuda}

need() { command -v "$1" >/dev/null 2>&1 || { echo "error: '$1' not found: $2" >&2; exit 1; }; }

setup_venv() {
  need cargo "install a Rust toolchain (https://rustup.rs)"
  need python3 "install Python 3.9 or newer"
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
  fi
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$ROOT/requirements-dev.txt"
}

# torch (CUDA build from PyPI, usable on CPU-only machines): CUBEATTN_TORCH=0 skips it and the torch
# tests skip themselves
setup_torch() {
  if [ "${CUBEATTN_TORCH:-1}" != 0 ]; then
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir -r "$ROOT/requirements-torch.txt"
  fi
}

build_wheel() {
  rm -f "$ROOT"/dist/cubeattn-*.whl
  # --features replaces pyproject's list, so `python` (the PyO3 bindings) is always named here
  "$VENV/bin/maturin" build --release --quiet -o "$ROOT/dist" --features "python${FEATURES:+,$FEATURES}"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$ROOT"/dist/cubeattn-*.whl
}
