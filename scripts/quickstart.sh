#!/usr/bin/env bash
# Fresh machine -> installed wheel -> the benchmark on the best device present (CPU without a GPU).
# Extra arguments go to `python -m cubeattn.bench` (default: --quick).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
setup_venv
build_wheel
"$VENV/bin/python" -c "import cubeattn, json; print(json.dumps(cubeattn.backend_status(), indent=1))"
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--quick)
"$VENV/bin/python" -m cubeattn.bench "${args[@]}"
