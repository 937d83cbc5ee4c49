"""GPU reliability (issue 13), marked `gpu` (skipped without a usable CUDA backend):

* concurrency: several Python threads calling forward and backward at once on one GPU (numpy
  inputs through the host path and torch CUDA tensors through the device path), 1000 calls in
  all, every result checked against the CPU backend on the same inputs, no deadlock (a watchdog
  fails the test); the GIL is released (a pure-Python thread keeps running meanwhile); the same on
  two GPUs at once (skipped with fewer than 2);
* leaks: 1000 forward+backward calls with varying shapes; driver-reported device memory in use
  (cudaMemGetInfo through torch, else the driver's free memory from cubeattn.devices()) and host RSS
  sampled along the way and written as JSON to $CUBEATTN_LEAK_JSON (default: the test's tmp dir);
  after the warm-up both must come back to their level.

Run on the GPU box: `scripts/gpu-test.sh test` (pytest -m 'gpu or torch'), or
`CUBEATTN_LEAK_JSON=bench/results/<dir>/leak.json pytest -m gpu tests/python/test_gpu_reliability.py`."""
import json
import os
import threading
import time

import numpy as np
import pytest

import cubeattn
from conftest import cuda_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a usable CUDA backend")]

try:
    import torch
except Exception:  # pragma: no cover - torch is optional
    torch = None

CALLS = 1000
WATCHDOG_S = float(os.environ.get("CUBEATTN_WATCHDOG_S", "600"))


def gpu_count():
    return len(cubeattn.devices())


# shapes of the concurrency and leak runs: (seqlens_q, seqlens_k, heads_q, heads_kv, head_dim, dtype, causal)
SHAPES = [
    ([128], [128], 4, 2, 64, "float16", True),
    ([300, 77], [300, 200], 8, 2, 128, "bfloat16", False),
    ([1, 64, 129], [1, 64, 129], 4, 4, 64, "float16", True),
    ([1024], [1024], 8, 1, 128, "bfloat16", True),
    ([40], [640], 4, 1, 64, "float16", False),  # few rows, many keys: the split-K combine
    ([513], [257], 2, 2, 128, "float16", True),
    ([2048], [2048], 4, 2, 64, "bfloat16", True),
    ([16, 16, 16, 16], [16, 16, 16, 16], 2, 1, 64, "float16", False),
]


def make_case(i, seed):
    from conftest import rand

    lq, lk, hq, hkv, d, dtype, causal = SHAPES[i % len(SHAPES)]
    rng = np.random.default_rng(seed)
    cu_q = np.cumsum([0] + lq).astype(np.int32)
    cu_k = np.cumsum([0] + lk).astype(np.int32)
    q = rand(rng, (cu_q[-1], hq, d), dtype)
    k, v = rand(rng, (cu_k[-1], hkv, d), dtype), rand(rng, (cu_k[-1], hkv, d), dtype)
    dout = rand(rng, q.shape, dtype)
    return dict(q=q, k=k, v=v, dout=dout, cu_q=cu_q, cu_k=cu_k, mq=max(lq), mk=max(lk), causal=causal)


def run_case(c, device, deterministic=True):
    out, lse = cubeattn.flash_attn_varlen_func(c["q"], c["k"], c["v"], c["cu_q"], c["cu_k"], c["mq"], c["mk"],
                                               causal=c["causal"], return_lse=True, device=device)
    grads = cubeattn.flash_attn_varlen_backward(c["dout"], c["q"], c["k"], c["v"], out, lse, c["cu_q"], c["cu_k"],
                                                c["mq"], c["mk"], causal=c["causal"], deterministic=deterministic,
                                                device=device)
    return out, lse, grads


def close(a, b, what):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    fin = np.isfinite(b)
    assert np.array_equal(np.isfinite(a), fin), f"{what}: non-finite pattern differs"
    scale = max(1.0, float(np.abs(b[fin]).max()) if fin.any() else 1.0)
    err = float(np.abs(a[fin] - b[fin]).max()) if fin.any() else 0.0
    assert err <= 3e-2 * scale, f"{what}: max abs error {err} (scale {scale})"


def run_threads(workers, n_threads, watchdog=WATCHDOG_S):
    """Runs workers(t) for t in range(n_threads) in threads; fails on an exception or a thread still
    alive after `watchdog` seconds (a deadlock)."""
    errors = []

    def wrap(t):
        try:
            workers(t)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(f"thread {t}: {type(e).__name__}: {e}")

    ts = [threading.Thread(target=wrap, args=(t,), daemon=True) for t in range(n_threads)]
    t0 = time.monotonic()
    for t in ts:
        t.start()
    for t in ts:
        t.join(max(0.0, watchdog - (time.monotonic() - t0)))
    alive = [i for i, t in enumerate(ts) if t.is_alive()]
    assert not alive, f"threads {alive} still running after {watchdog} s: deadlock or hang"
    assert not errors, "\n".join(errors[:5])
    return time.monotonic() - t0


def test_threads_on_one_gpu_give_correct_results_without_deadlock():
    n_threads, per_thread = 4, CALLS // 4
    cases = [make_case(i, 100 + i) for i in range(len(SHAPES))]
    want = [run_case(c, "cpu") for c in cases]
    use_torch = torch is not None and torch.cuda.is_available()
    tcases = []
    if use_torch:
        for c in cases:
            tcases.append({**c, **{n: torch.from_numpy(np.asarray(c[n], np.float32)).to(
                {"float16": torch.float16, "bfloat16": torch.bfloat16}[str(c["q"].dtype)]).cuda()
                for n in ("q", "k", "v", "dout")}})
    done = [0] * n_threads
    ticks = [0]
    stop = threading.Event()

    def ticker():  # pure Python: advances only while the calls release the GIL
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.0005)

    def worker(t):
        for j in range(per_thread):
            i = (t + j) % len(cases)
            torch_path = use_torch and (t + j) % 2 == 1
            c = tcases[i] if torch_path else cases[i]
            out, lse, grads = run_case(c, "cuda", deterministic=(j % 3 != 0))
            if torch_path:
                out, lse = out.float().cpu().numpy(), lse.cpu().numpy()
                grads = [g.float().cpu().numpy() for g in grads]
            w_out, w_lse, w_grads = want[i]
            close(out, w_out, f"out of case {i}")
            close(lse, w_lse, f"lse of case {i}")
            for name, g, wg in zip(("dq", "dk", "dv"), grads, w_grads):
                close(g, wg, f"{name} of case {i}")
            done[t] += 1

    tk = threading.Thread(target=ticker, daemon=True)
    tk.start()
    try:
        secs = run_threads(worker, n_threads)
    finally:
        stop.set()
        tk.join(5)
    assert sum(done) == n_threads * per_thread == CALLS
    # the ticker thread ran while the GPU calls were in flight (the GIL is released)
    assert ticks[0] > 10, f"a pure-Python thread advanced {ticks[0]} times in {secs:.1f} s"


@pytest.mark.skipif(gpu_count() < 2, reason="needs 2 GPUs")
def test_threads_on_two_gpus_at_once():
    n_threads, per_thread = 4, CALLS // 4
    cases = [make_case(i, 200 + i) for i in range(len(SHAPES))]
    want = [run_case(c, "cpu") for c in cases]

    def worker(t):
        dev = f"cuda:{t % 2}"
        for j in range(per_thread):
            i = (t * 3 + j) % len(cases)
            out, lse, grads = run_case(cases[i], dev)
            assert cubeattn.last_backend() == "cuda"
            w_out, w_lse, w_grads = want[i]
            close(out, w_out, f"{dev} out of case {i}")
            for name, g, wg in zip(("dq", "dk", "dv"), grads, w_grads):
                close(g, wg, f"{dev} {name} of case {i}")

    run_threads(worker, n_threads)


def device_used_bytes(index=0):
    """Bytes in use on the GPU as the driver reports them (total - free)."""
    if torch is not None and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(index)
        return total - free
    d = cubeattn.devices()[index]
    return d["total_memory"] - d["free_memory"]


def host_rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_no_leak_over_1000_forward_backward_calls(tmp_path):
    use_torch = torch is not None and torch.cuda.is_available()
    cases = [make_case(i, 300 + i) for i in range(len(SHAPES))]
    samples = []
    warmup = 100
    t0 = time.monotonic()
    for n in range(CALLS):
        c = cases[n % len(cases)]
        if use_torch and n % 2 == 1:
            # torch CUDA tensors through autograd (the device path, torch's caching allocator)
            dt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[str(c["q"].dtype)]
            q, k, v = (torch.from_numpy(np.asarray(c[x], np.float32)).to(dt).cuda().requires_grad_()
                       for x in ("q", "k", "v"))
            out = cubeattn.flash_attn_varlen_func(q, k, v, c["cu_q"], c["cu_k"], c["mq"], c["mk"], causal=c["causal"])
            out.backward(torch.ones_like(out))
            del q, k, v, out
        else:
            run_case(c, "cuda", deterministic=n % 3 == 0)
        if n % 10 == 9 or n == 0:
            if use_torch:
                torch.cuda.synchronize()
            samples.append(dict(call=n + 1, t=round(time.monotonic() - t0, 3), device_used=device_used_bytes(),
                                host_rss=host_rss_bytes()))
    path = os.environ.get("CUBEATTN_LEAK_JSON") or str(tmp_path / "leak.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    devs = cubeattn.devices()
    meta = dict(calls=CALLS, warmup=warmup, shapes=[list(map(str, s)) for s in SHAPES], torch=use_torch,
                device=devs[0]["name"] if devs else None, cubeattn=cubeattn.__version__)
    with open(path, "w") as f:
        json.dump(dict(meta=meta, samples=samples), f, indent=1)
    print(f"leak curve: {len(samples)} samples written to {path}")
    after = [s for s in samples if s["call"] > warmup]
    # the level after warm-up: the largest of the first 100 samples after it (every shape has run)
    ref = after[: max(1, len(after) // 9)]
    for key, slack in (("device_used", 64 << 20), ("host_rss", 64 << 20)):
        level = max(s[key] for s in ref)
        last = [s[key] for s in after[-10:]]
        assert max(last) <= level + slack, (
            f"{key} grew from {level / 2**20:.1f} MiB after warm-up to {max(last) / 2**20:.1f} MiB after {CALLS} calls")
        # and no steady growth: the slope over the run after warm-up stays under 16 KiB per call
        xs = np.array([s["call"] for s in after], np.float64)
        ys = np.array([s[key] for s in after], np.float64)
        slope = np.polyfit(xs, ys, 1)[0] if len(xs) > 2 else 0.0
        assert slope < 16 << 10, f"{key} grows by {slope / 1024:.1f} KiB per call after warm-up"
