#!/usr/bin/env bash
# GPU workflows for cubeattn.
#
#   scripts/gpu-test.sh COMMAND [TARGET] [--verbose] [--release] [--iterations N] [--min-vram GB]
#                       [--log-dir DIR] [--sanitize] [--stress] [--portable]
#
# COMMAND   validate   GPU, driver, NVRTC, CUDA headers, free VRAM >= --min-vram, CubeCL starts
#                      (with --sanitize, then the sanitize command)
#           test       GPU tests of TARGET (Rust test binary + pytest -m 'gpu or torch'); with
#                      --stress and TARGET sparse or all, also the block-sparse checks at seed
#                      004's larger configurations (bench sparse --test_patterns --stress)
#           sanitize   compute-sanitizer memcheck, racecheck, synccheck and initcheck over small
#                      calls of each kernel family (forward, split-K combine, backward with the
#                      dQ pass and with atomic dQ, grouped, block-sparse forward / backward / INT8,
#                      sliding window, the non-finite-v flag, decode-sized calls; sanitize_driver.py;
#                      CUBEATTN_SAN_FAMILIES="a b" / CUBEATTN_SAN_TOOLS="t" run only those):
#                      one log per tool and family plus summary.txt in --log-dir DIR (default
#                      bench/results/sanitize-<UTC time>); exit 1 on any reported error
#           benchmark  python -m cubeattn.bench for TARGET, JSON + table under bench/results/
#           profile    ncu (--clock-control none) on one kernel launch of TARGET: registers,
#                      shared memory, duration, achieved TFLOP/s; falls back to nsys
#           clean      remove build outputs, wheels and logs
# TARGET    flash_attention | grouped | sparse | zigzag | sage | callpath | candle | all   (default:
#           all; `sage`: the INT8 / FP8 SageAttention path (`bench sage` non-causal and causal 8K /
#           16K, `bench sparse --quant_gran per_warp --pv-precision fp8`); `callpath`: what a user
#           feels around the kernels (`bench callpath`: small calls, decode, kvcache, host overhead,
#           first calls; `bench hf_train`: a transformers Llama training beside sdpa); `all` leaves
#           out candle: cubeattn's candle ops on candle CUDA tensors, feature candle-cuda, run from
#           the binaries scripts/build-candle-cuda.sh makes: CUBEATTN_CANDLE_DIR=DIR (default
#           .carry/candle) holds them; with cargo and no DIR, that script builds them. `test candle`
#           runs tests/candle_gpu.rs and examples/candle_cuda_block.rs, `benchmark candle`
#           examples/candle_cuda_bench.rs: JSON + table under bench/results/candle-cuda-<time>/)
# --portable  the kernels as built for GPUs below sm_90 (CUBEATTN_CUDA_PORTABLE=1: no tensor maps,
#             bulk copies, float2 atomics, try_wait or stmatrix): their code paths on a Hopper GPU
#
# Two ways to run:
#  * on a GPU box with cargo: builds the test binary (cargo test --features cuda --no-run) and the
#    wheel (maturin, features python,cuda) as needed;
#  * on a GPU box without cargo, from prebuilt artifacts made elsewhere: point CUBEATTN_TEST_BIN at
#    the gpu_main test binary and CUBEATTN_WHEEL at the wheel (or have cubeattn installed already).
# CUDA_PATH defaults to /usr/local/cuda (CubeCL needs the CUDA headers at run time).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

# the comment block at the top of this file, without its '#'
usage() { awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; }

CMD=${1:-}
[ $# -gt 0 ] && shift
TARGET=all
VERBOSE=0
PROFILE=debug
ITER=20
MIN_VRAM=0
SAN_DIR=
SANITIZE=0
STRESS=0
while [ $# -gt 0 ]; do
  case "$1" in
    flash_attention|grouped|sparse|zigzag|sage|callpath|candle|all) TARGET=$1 ;;
    --verbose|-v) VERBOSE=1 ;;
    --release) PROFILE=release ;;
    --iterations) ITER=${2:?--iterations needs a number}; shift ;;
    --min-vram) MIN_VRAM=${2:?--min-vram needs a number of GB}; shift ;;
    --log-dir) SAN_DIR=${2:?--log-dir needs a directory}; shift ;;
    --sanitize) SANITIZE=1 ;;
    --stress) STRESS=1 ;;
    --portable) export CUBEATTN_CUDA_PORTABLE=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "error: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
case "$ITER" in ''|*[!0-9]*) echo "error: --iterations must be a positive integer, got '$ITER'" >&2; exit 2 ;; esac
case "$MIN_VRAM" in ''|*[!0-9.]*) echo "error: --min-vram must be a number of GB, got '$MIN_VRAM'" >&2; exit 2 ;; esac

export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda}
PY=${PYTHON:-python3}
[ -x "$ROOT/.venv/bin/python" ] && [ -z "${PYTHON:-}" ] && PY="$ROOT/.venv/bin/python"
LOG_DIR=${CUBEATTN_LOG_DIR:-$ROOT/bench/results}
log() { [ "$VERBOSE" = 1 ] && echo "[gpu-test] $*" >&2; return 0; }
fail() { echo "error: $*" >&2; exit 1; }

built_targets="flash_attention grouped sparse zigzag sage callpath"
# NVLink multicast off in NCCL, PyTorch's symmetric memory and NVSHMEM (torchrun targets): on shared
# multi-GPU hosts a program using it can take the GPUs out of service
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}

gpu_count() { nvidia-smi -L 2>/dev/null | grep -c '^GPU'; }
not_built() { echo "$1: not built yet"; }

targets() {
  if [ "$TARGET" = all ]; then echo flash_attention grouped sparse sage callpath zigzag; else echo "$TARGET"; fi
}

# ---------------------------------------------------------------- pieces

check_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 || fail "nvidia-smi not found: no NVIDIA driver on this machine"
  local q
  q=$(nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.free,compute_cap --format=csv,noheader,nounits 2>&1) \
    || fail "nvidia-smi failed: $q"
  [ -n "$q" ] || fail "nvidia-smi lists no GPU"
  echo "GPUs (index, name, driver, total MiB, free MiB, compute capability):"
  echo "$q" | sed 's/^/  /'
  local free_mib
  free_mib=$(echo "$q" | head -1 | awk -F', ' '{print $5}')
  awk -v f="$free_mib" -v m="$MIN_VRAM" 'BEGIN { exit !(f / 1024 >= m) }' \
    || fail "GPU 0 has $(awk -v f="$free_mib" 'BEGIN{printf "%.1f", f/1024}') GB free, less than --min-vram $MIN_VRAM GB"
  echo "free VRAM ok (>= $MIN_VRAM GB)"
}

check_nvrtc() {
  if ldconfig -p 2>/dev/null | grep -q 'libnvrtc\.so'; then echo "NVRTC: $(ldconfig -p | grep -m1 'libnvrtc\.so' | awk '{print $NF}')"; return; fi
  for d in "$CUDA_PATH/lib64" "$CUDA_PATH/lib" ${LD_LIBRARY_PATH//:/ }; do
    if ls "$d"/libnvrtc.so* >/dev/null 2>&1; then echo "NVRTC: $(ls "$d"/libnvrtc.so* | head -1)"; return; fi
  done
  fail "libnvrtc.so not found (ldconfig, \$CUDA_PATH/lib64, LD_LIBRARY_PATH): CubeCL compiles kernels with NVRTC at run time"
}

check_headers() {
  [ -f "$CUDA_PATH/include/cuda.h" ] || fail "CUDA headers not found at \$CUDA_PATH/include (CUDA_PATH=$CUDA_PATH); set CUDA_PATH"
  echo "CUDA headers: $CUDA_PATH/include"
}

ensure_wheel() {
  if [ -n "${CUBEATTN_WHEEL:-}" ]; then
    log "installing $CUBEATTN_WHEEL"
    "$PY" -m pip install -q --no-deps --force-reinstall "$CUBEATTN_WHEEL" || fail "could not install $CUBEATTN_WHEEL"
    # benchmark records name the wheel's commit (scripts/build-gpu-artifacts.sh writes DIR/COMMIT)
    local c; c=$(cat "$(dirname "$CUBEATTN_WHEEL")/COMMIT" 2>/dev/null || true)
    [ -n "$c" ] && export CUBEATTN_COMMIT=${CUBEATTN_COMMIT:-$c}
  elif ! "$PY" -c "import cubeattn" >/dev/null 2>&1; then
    command -v cargo >/dev/null 2>&1 || fail "cubeattn is not installed and there is no cargo: set CUBEATTN_WHEEL to a wheel built with the cuda feature"
    log "building the wheel (features python,cuda)"
    CUBEATTN_FEATURES=cuda bash -c "source '$ROOT/scripts/env.sh'; setup_venv; build_wheel" || fail "wheel build failed"
    PY="$ROOT/.venv/bin/python"
  fi
  "$PY" -c "import cubeattn, sys; st = cubeattn.backend_status(); sys.exit(0 if st['cuda_compiled'] else 3)" \
    || fail "the installed cubeattn was built without the cuda feature"
}

test_bin() {
  if [ -n "${CUBEATTN_TEST_BIN:-}" ]; then
    [ -x "$CUBEATTN_TEST_BIN" ] || fail "CUBEATTN_TEST_BIN=$CUBEATTN_TEST_BIN is not an executable"
    echo "$CUBEATTN_TEST_BIN"; return
  fi
  command -v cargo >/dev/null 2>&1 || fail "no cargo here: set CUBEATTN_TEST_BIN to a gpu_main test binary built with --features cuda"
  local flag=()
  [ "$PROFILE" = release ] && flag=(--release)
  local out
  out=$(cargo test "${flag[@]}" --features cuda --test gpu_main --no-run --message-format=json 2>/dev/null) \
    || fail "cargo test --features cuda --no-run failed (run it by hand to see why)"
  echo "$out" | "$PY" -c "import sys, json
for l in sys.stdin:
    m = json.loads(l)
    if m.get('reason') == 'compiler-artifact' and m['target']['name'] == 'gpu_main' and m.get('executable'):
        print(m['executable'])" | tail -1
}

cubecl_starts() {
  ensure_wheel
  "$PY" - <<'PY' || fail "the CubeCL CUDA runtime did not start (see above)"
import cubeattn, sys
st = cubeattn.backend_status()
print("cubeattn backend:", st["reason"])
for d in st["devices"]:
    print(f"  GPU {d['index']}: {d['name']} cc {d['compute_capability']}, {d['sm_count']} SMs, cubecl_ok={d['cubecl_ok']}")
sys.exit(0 if st["cuda_available"] else 1)
PY
}

# The directory with the candle-cuda binaries (scripts/build-candle-cuda.sh), built here if
# missing and cargo is there; fails when a library they link is not found.
candle_dir() {
  local dir=${CUBEATTN_CANDLE_DIR:-$ROOT/.carry/candle}
  if [ ! -x "$dir/candle_gpu" ]; then
    command -v cargo >/dev/null 2>&1 || fail "no candle-cuda binaries in $dir and no cargo: build them elsewhere with scripts/build-candle-cuda.sh DIR and set CUBEATTN_CANDLE_DIR=DIR"
    log "building the candle-cuda binaries into $dir"
    bash "$ROOT/scripts/build-candle-cuda.sh" "$dir" >&2 || fail "scripts/build-candle-cuda.sh failed"
  fi
  local f missing
  candle_libs
  for f in candle_gpu candle_cuda_block candle_cuda_bench; do
    [ -x "$dir/$f" ] || fail "$dir/$f is missing: rebuild with scripts/build-candle-cuda.sh $dir"
    missing=$(ldd "$dir/$f" 2>/dev/null | grep 'not found' || true)
    [ -z "$missing" ] || fail "$f links libraries not found (put their directory on LD_LIBRARY_PATH):
$missing"
  done
  echo "$dir"
}

# The candle-cuda binaries are linked against the CUDA libraries: the toolkit's lib64 first (set
# only for them: torch finds its own CUDA libraries).
candle_libs() { export LD_LIBRARY_PATH=$CUDA_PATH/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}; }

do_test_candle() {
  local dir status=0
  dir=$(candle_dir) || exit 1
  candle_libs
  [ -f "$dir/COMMIT" ] && echo "candle-cuda binaries of commit $(cat "$dir/COMMIT")"
  echo "== candle on CUDA: tests/candle_gpu.rs ($dir/candle_gpu)"
  CUBEATTN_REQUIRE_GPU=1 "$dir/candle_gpu" --include-ignored --test-threads=1 $( [ "$VERBOSE" = 1 ] && echo --nocapture ) || status=1
  echo "== candle on CUDA: examples/candle_cuda_block.rs"
  "$dir/candle_cuda_block" || status=1
  exit $status
}

# ---------------------------------------------------------------- commands

do_validate() {
  check_gpu
  check_nvrtc
  check_headers
  cubecl_starts
  echo "validate: ok"
  [ "$SANITIZE" = 1 ] && do_sanitize
  return 0
}

SAN_TOOLS=${CUBEATTN_SAN_TOOLS:-"memcheck racecheck synccheck initcheck"}
SAN_FAMILIES=${CUBEATTN_SAN_FAMILIES:-"forward splitk backward_pass backward_atomic grouped paged decode sparse sparse_backward sparse_int8 window nonfinite head_dims padded"}

do_sanitize() {
  check_gpu >/dev/null
  ensure_wheel
  local cs
  cs=$(command -v compute-sanitizer || true)
  [ -z "$cs" ] && [ -x "$CUDA_PATH/bin/compute-sanitizer" ] && cs="$CUDA_PATH/bin/compute-sanitizer"
  [ -n "$cs" ] || fail "compute-sanitizer not found (PATH, \$CUDA_PATH/bin): it ships with the CUDA toolkit"
  local dir=${SAN_DIR:-$LOG_DIR/sanitize-$(date -u +%Y%m%dT%H%M%SZ)}
  mkdir -p "$dir" || fail "cannot create $dir"
  local summary="$dir/summary.txt" status=0
  {
    echo "compute-sanitizer: $("$cs" --version 2>/dev/null | tail -1)"
    echo "cubeattn: $("$PY" -c 'import cubeattn; print(cubeattn.__version__, cubeattn.backend_status()["reason"])' 2>&1)"
    echo "commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  } > "$summary"
  # a private kernel cache: NVRTC compiles under the sanitizer once per family, then loads
  export CUBEATTN_CACHE_DIR=${CUBEATTN_CACHE_DIR:-$dir/kernel-cache}
  for tool in $SAN_TOOLS; do
    local extra=()
    [ "$tool" = racecheck ] && extra=(--racecheck-report all)
    for fam in $SAN_FAMILIES; do
      local log="$dir/$tool-$fam.log" out="$dir/$tool-$fam.out" rc
      echo "== $tool $fam"
      "$cs" --tool "$tool" "${extra[@]}" --error-exitcode 99 --log-file "$log" \
        "$PY" "$ROOT/tests/python/sanitize_driver.py" "$fam" > "$out" 2>&1
      rc=$?
      local errs
      # memcheck/synccheck/initcheck: "ERROR SUMMARY: N errors"; racecheck: "RACECHECK SUMMARY: N hazards"
      errs=$(grep -Eo '(ERROR|RACECHECK) SUMMARY: [0-9]+' "$log" | tail -1 | grep -Eo '[0-9]+$' || true)
      [ -z "$errs" ] && errs="?"
      printf '%-10s %-16s exit %-3s sanitizer errors %s\n' "$tool" "$fam" "$rc" "$errs" | tee -a "$summary"
      # 99: the sanitizer found errors; anything else non-zero: the driver failed (wrong result, crash)
      [ "$rc" = 0 ] && [ "$errs" = 0 ] || status=1
    done
  done
  echo "logs and summary: $dir"
  return $status
}

do_test() {
  check_gpu >/dev/null
  [ "$TARGET" = candle ] && do_test_candle
  local bin status=0 ran=0
  bin=$(test_bin) || exit 1
  ensure_wheel
  for t in $(targets); do
    case " $built_targets " in
      *" $t "*) ;;
      *) not_built "$t"; [ "$TARGET" = all ] && continue; exit 2 ;;
    esac
    if [ "$t" = zigzag ]; then
      if [ "$TARGET" = zigzag ]; then
        # the extract/scatter kernels on one GPU (with `all` the flash_attention suites run them)
        echo "== zigzag: extract/scatter kernels (Rust gpu::zigzag, pytest test_zigzag_gpu.py), the cuDNN baseline (test_lse_split.py)"
        CUBEATTN_REQUIRE_GPU=1 "$bin" --include-ignored --test-threads=1 gpu::zigzag || status=1
        (cd "$ROOT/tests/python" && "$PY" -m pytest -q -p no:cacheprovider test_zigzag_gpu.py test_lse_split.py) || status=1
      fi
      # the whole layer on CUDA tensors with W = 1..4 on one GPU: four ranks, gloo collectives
      for dt in bfloat16 float16; do
        echo "== zigzag: torchrun --nproc_per_node 4 zigzag_worker.py --backend gloo --device cuda --dtype $dt (one GPU)"
        "$PY" -m torch.distributed.run --standalone --nproc_per_node 4 "$ROOT/tests/python/zigzag_worker.py" \
          --backend gloo --device cuda --dtype "$dt" || status=1
      done
      # context parallelism across GPUs: torchrun, one rank per GPU (NCCL), W = 1..N, bf16 and fp16
      local n; n=$(gpu_count)
      if [ "$n" -lt 2 ]; then echo "zigzag: NCCL across GPUs needs >= 2 GPUs, found $n: skipped"; continue; fi
      for dt in bfloat16 float16; do
        echo "== zigzag: torchrun --nproc_per_node $n tests/python/zigzag_worker.py --dtype $dt"
        "$PY" -m torch.distributed.run --standalone --nproc_per_node "$n" "$ROOT/tests/python/zigzag_worker.py" --dtype "$dt" || status=1
      done
      echo "== zigzag: examples/zigzag_cp.py"
      "$PY" -m torch.distributed.run --standalone --nproc_per_node "$n" "$ROOT/examples/zigzag_cp.py" || status=1
      continue
    fi
    # grouped and block-sparse attention share the kernels and the test binary with
    # flash_attention: their cases (packed tiles, overlapping windows, empty groups, block lists)
    # are part of the same suites (Rust gpu_main, pytest -m gpu: test_sparse_gpu.py).
    [ $ran = 1 ] && continue
    ran=1
    echo "== Rust GPU tests ($bin)"
    # the GPU tests are #[ignore]d (so a GPU-less `cargo test` lists them as ignored); here they
    # run, and a CUDA backend that cannot start fails them instead of skipping
    CUBEATTN_REQUIRE_GPU=1 "$bin" --include-ignored --test-threads=1 $( [ "$VERBOSE" = 1 ] && echo --nocapture ) || status=1
    echo "== pytest -m 'gpu or torch' (torch: autograd on CPU and CUDA tensors)"
    (cd "$ROOT/tests/python" && "$PY" -m pytest -q -p no:cacheprovider -m "gpu or torch") || status=1
    if [ "$STRESS" = 1 ] && { [ "$TARGET" = sparse ] || [ "$TARGET" = all ]; }; then
      for c in --causal --no-causal; do
        echo "== block-sparse stress checks ($c): python -m cubeattn.bench sparse --test_patterns --stress"
        "$PY" -m cubeattn.bench sparse --device cuda --test_patterns --stress $c || status=1
      done
    fi
  done
  exit $status
}

do_benchmark() {
  check_gpu >/dev/null
  local stamp status=0
  stamp=$(date -u +%Y%m%dT%H%M%SZ)
  if [ "$TARGET" = candle ]; then
    local dir; dir=$(candle_dir) || exit 1
    candle_libs
    CUBEATTN_COMMIT=${CUBEATTN_COMMIT:-$(cat "$dir/COMMIT" 2>/dev/null || true)} \
      "$dir/candle_cuda_bench" --iters "$ITER" --out "$LOG_DIR/candle-cuda-$stamp"
    exit $?
  fi
  ensure_wheel
  mkdir -p "$LOG_DIR"
  for t in $(targets); do
    case "$t" in
      flash_attention)
        "$PY" -m cubeattn.bench dense --device cuda --iterations "$ITER" --json "$LOG_DIR/dense-$stamp.json" | tee "$LOG_DIR/dense-$stamp.txt" || status=1
        "$PY" -m cubeattn.bench fwdbwd --device cuda --iterations "$ITER" --json "$LOG_DIR/fwdbwd-$stamp.json" | tee "$LOG_DIR/fwdbwd-$stamp.txt" || status=1 ;;
      grouped) "$PY" -m cubeattn.bench grouped --device cuda --iterations "$ITER" --json "$LOG_DIR/grouped-$stamp.json" | tee "$LOG_DIR/grouped-$stamp.txt" || status=1 ;;
      sparse)
        "$PY" -m cubeattn.bench sparse --device cuda --no-causal --iterations "$ITER" --json "$LOG_DIR/sparse-$stamp.json" | tee "$LOG_DIR/sparse-$stamp.txt" || status=1
        "$PY" -m cubeattn.bench sparse --device cuda --causal --iterations "$ITER" --json "$LOG_DIR/sparse-causal-$stamp.json" | tee "$LOG_DIR/sparse-causal-$stamp.txt" || status=1 ;;
      sage)
        for c in --no-causal --causal; do
          "$PY" -m cubeattn.bench sage --device cuda $c --iterations "$ITER" --json "$LOG_DIR/sage${c#--}-$stamp.json" \
            | tee "$LOG_DIR/sage${c#--}-$stamp.txt" || status=1
        done
        "$PY" -m cubeattn.bench sparse --device cuda --no-causal --quant_gran per_warp --pv-precision fp8 --iterations "$ITER" \
          --json "$LOG_DIR/sparse-fp8-$stamp.json" | tee "$LOG_DIR/sparse-fp8-$stamp.txt" || status=1 ;;
      callpath)
        "$PY" -m cubeattn.bench callpath --device cuda --json "$LOG_DIR/callpath-$stamp.json" | tee "$LOG_DIR/callpath-$stamp.txt" || status=1
        "$PY" -m cubeattn.bench hf_train --device cuda --json "$LOG_DIR/client-$stamp.json" | tee "$LOG_DIR/client-$stamp.txt" || status=1 ;;
      zigzag)
        # one rank per GPU; W = 2 and 4 where there are that many GPUs; 16K tokens per GPU
        local n; n=$(gpu_count)
        [ "$n" -ge 2 ] || { echo "zigzag: needs >= 2 GPUs, found $n: skipped"; continue; }
        for w in 2 4; do
          [ "$n" -ge "$w" ] || continue
          "$PY" -m torch.distributed.run --standalone --nproc_per_node "$w" -m cubeattn.bench zigzag --device cuda \
            --iterations "$ITER" --json "$LOG_DIR/cp-W$w-$stamp.json" | tee "$LOG_DIR/cp-W$w-$stamp.txt" || status=1
        done ;;
      *) not_built "$t"; [ "$TARGET" = all ] || exit 2 ;;
    esac
  done
  exit $status
}

do_profile() {
  check_gpu >/dev/null
  ensure_wheel
  local t=$TARGET
  [ "$t" = all ] && t=flash_attention
  local what=dense
  case "$t" in
    flash_attention) what=dense ;;
    grouped) what=grouped ;;
    *) not_built "$t"; exit 2 ;;
  esac
  local args=(-m cubeattn.bench "$what" --device cuda --quick --iterations 1 --seqlens 8192 --configs llama3-8b)
  if command -v ncu >/dev/null 2>&1; then
    echo "== ncu on the first cubeattn kernel launch ($what)"
    ncu --clock-control none --target-processes all -k "regex:flash|attn|fwd" -c 1 \
      --section LaunchStats --section SpeedOfLight --section Occupancy \
      --metrics sm__inst_executed_pipe_tensor.sum,gpu__time_duration.sum,launch__registers_per_thread,launch__shared_mem_per_block_dynamic \
      "$PY" "${args[@]}" 2>&1 | tee "$LOG_DIR/profile-$t.txt" | grep -E "Registers|Shared Memory|Duration|Throughput|Occupancy|tensor|==PROF==|Error" 
    echo "(full report: $LOG_DIR/profile-$t.txt; TFLOP/s = the kernel's FLOPs from the bench table / Duration)"
  elif command -v nsys >/dev/null 2>&1; then
    nsys profile -o "$LOG_DIR/profile-$t" "$PY" "${args[@]}" && nsys stats "$LOG_DIR/profile-$t.nsys-rep" | head -60
  else
    fail "neither ncu nor nsys is on the PATH"
  fi
}

do_clean() {
  rm -rf "$ROOT/target" "$ROOT/dist" "$ROOT/tests/python/.pytest_cache" "$ROOT/.hypothesis"
  echo "removed target/, dist/ and test caches"
}

case "$CMD" in
  validate) do_validate; exit $? ;;
  sanitize) do_sanitize; exit $? ;;
  test) do_test ;;
  benchmark) do_benchmark ;;
  profile) do_profile ;;
  clean) do_clean ;;
  -h|--help) usage; exit 0 ;;
  "") usage >&2; exit 2 ;;
  *) echo "error: unknown command '$CMD': expected validate | test | sanitize | benchmark | profile | clean" >&2; exit 2 ;;
esac
