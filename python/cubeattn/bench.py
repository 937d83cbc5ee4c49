"""Benchmarks: ``python -m cubeattn.bench [dense|grouped|fwdbwd|autograd|callpath|zigzag|sparse|sage|hf_train] [options]``.

``python -m cubeattn.bench figure --from <json files> -o out.png`` draws recorded rows instead
(cubeattn beside the peers of the same run; needs matplotlib; ``figure --help``).

``zigzag`` runs under torchrun (one rank per GPU): ``torchrun --nproc_per_node 2 -m cubeattn.bench
zigzag --json cp.json`` (on the CPU with gloo too, with small shapes: ``--device cpu``).

Times cubeattn beside the peers a user would otherwise pick, in the same run, on the same shapes:
  * CPU: torch's scaled_dot_product_attention on the CPU (when torch is importable) and a naive
    numpy implementation;
  * CUDA: torch SDPA (flash and cuDNN backends), FlexAttention, and for grouped attention the
    per-group calls that people make today.
``sparse`` times block-sparse attention at several kept fractions beside our dense path on the same
inputs (CUDA: forward and forward+backward, with SDPA flash and FlexAttention with the same BlockMask).
``sage`` (CUDA only) times ``cubeattn.sageattn`` (INT8 Q K^T) beside our exact forward and SDPA cuDNN /
flash, with the accuracy of each against an f64 reference (``--outliers``: also on K with outlier channels).
``hf_train`` trains a transformers Llama a few steps with cubeattn beside sdpa (see bench_hf.py).
Our CUDA kernel is timed on device-resident inputs (no host<->device copies) after warm-up.
Prints a table, writes JSON (``--json``), and a PNG plot when matplotlib is importable (``--png``).
"""
from __future__ import annotations

import argparse
import collections
import datetime as _dt
import json
import math
import os
import platform
import subprocess
import sys
import time

import numpy as np

import cubeattn

CONFIGS = {"llama3-8b": (32, 8, 128), "llama3-70b": (64, 8, 128), "gqa-d64": (32, 8, 64), "cpu-small": (8, 8, 128),
           # multi-head attention (every q head its own K, V), with --batch-size 4 the sage bench's shape
           "mha-d128": (32, 32, 128), "mha-d64": (32, 32, 64),
           # the other head dims with CUDA kernels (forward: all; backward: 32 and 96)
           "gqa-d32": (32, 8, 32), "gqa-d96": (32, 8, 96), "gqa-d192": (16, 8, 192), "gqa-d256": (16, 8, 256),
           # head dims without a kernel of their own (run on the next one with zero columns: d96, d192)
           "gqa-d80": (32, 8, 80), "gqa-d160": (16, 8, 160),
           # v with a head_dim of its own (`V_HEAD_DIMS`): DeepSeek's MLA in training (q, k 192, v 128)
           "mla-d192-v128": (16, 16, 192)}
# v's head_dim where a config's is not q's and k's (dense and fwdbwd benches)
V_HEAD_DIMS = {"mla-d192-v128": 128}


def causal_pairs(sq, sk):
    """Visible (query, key) pairs of one sequence with bottom-right causal alignment."""
    r = np.arange(sq, dtype=np.int64)
    return int(np.clip(sk - sq + r + 1, 0, sk).sum())


def _no_sync():
    pass


def _spread(ts):
    """(median, min, max) of the times `ts`."""
    ts = sorted(ts)
    return ts[len(ts) // 2], ts[0], ts[-1]


def _warm_up(step, warmup, sync, warm_s, sync_every):
    """`warmup` calls of `step`, and more until `warm_s` seconds have passed (at most 10000), synced
    every `sync_every` calls and at the end."""
    t0 = time.perf_counter()
    n = 0
    while n < warmup or (time.perf_counter() - t0 < warm_s and n < 10000):
        step()
        n += 1
        if n % sync_every == 0:
            sync()
    sync()


def median_ms(fn, warmup, iters, sync=_no_sync, warm_s=0.1):
    """(median, min, max) ms of `iters` calls of `fn`, each followed by `sync`, after `warmup` calls;
    on a device (a `sync` given) also after at least `warm_s` seconds of calls, as triton's do_bench
    warms up by time: the first row of a process otherwise meets the GPU at idle clocks (`warmup`
    is 2-3 calls in most rows). Pass `warm_s=0` where every process must make the same calls."""
    warm_s = warm_s if sync is not _no_sync else 0.0
    _warm_up(fn, warmup, sync, warm_s, 16)
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        sync()
        ts.append((time.perf_counter() - t) * 1e3)
    return _spread(ts)


def interleaved_ms(fns, warmup, iters, sync, rounds=4, warm_s=0.1):
    """{name: (median, min, max) ms} of `iters` synced calls of each `(name, fn)` in `fns`, taken
    in `rounds` rounds that visit every fn in turn (each round starting one fn later), after
    `warmup` calls of each and at least `warm_s` seconds of calls in turn. A GPU's clock moves
    with what ran just before and for how long (bench/results/h200x2-2026-11-30-cp-order): timed
    one after the other, the first and the last impl of a row meet different clocks; in turns,
    every impl meets the same mix."""
    fns = list(fns)

    def turn():
        for _, fn in fns:
            fn()
    _warm_up(turn, warmup, sync, warm_s, 1)
    per = max(1, -(-iters // rounds))
    ts = {name: [] for name, _ in fns}
    for r in range(rounds):
        for j in range(len(fns)):
            name, fn = fns[(j + r) % len(fns)]
            for _ in range(per):
                t = time.perf_counter()
                fn()
                sync()
                ts[name].append((time.perf_counter() - t) * 1e3)
    return {name: _spread(v) for name, v in ts.items()}


def _rows_in_turns(steps, iterations, sync, row, error, warm_s=0.1):
    """Times the `(impl, fn)` steps in turns (`interleaved_ms`, 3 warm-up calls each) and reports
    each with `row(impl, (median, min, max))`; a step whose first call raises is left out and
    reported with `error(impl, exception)`."""
    ok = []
    for impl, fn in steps:
        try:
            fn()
            ok.append((impl, fn))
        except Exception as e:  # report, keep the peers
            error(impl, e)
    for impl, ms in interleaved_ms(ok, 3, iterations, sync, warm_s=warm_s).items():
        row(impl, ms)


def _torch():
    try:
        import torch

        return torch
    except Exception:
        return None


def _has_torch():
    import importlib.util

    return importlib.util.find_spec("torch") is not None


_TORCH_CPU_PEER = """
import json, sys, time, torch
s, hq, hkv, d, causal, iters, grad = json.loads(sys.argv[1])
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, h, s, d, generator=g, requires_grad=grad) for h in (hq, hkv, hkv))
do = torch.randn(1, hq, s, d, generator=g)
sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
f = (lambda: sdpa().backward(do)) if grad else sdpa
f()
ts = []
for _ in range(iters):
    t = time.perf_counter(); f(); ts.append((time.perf_counter() - t) * 1e3)
ts.sort()
print(json.dumps({"ms": [ts[len(ts) // 2], ts[0], ts[-1]], "threads": torch.get_num_threads()}))
"""


def _torch_cpu_peer(s, hq, hkv, d, causal, iters, grad=False):
    """torch's CPU scaled_dot_product_attention (with `grad`: forward + backward) timed in a child
    process (same shapes)."""
    r = subprocess.run([sys.executable, "-c", _TORCH_CPU_PEER, json.dumps([s, hq, hkv, d, causal, iters, grad])],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": r.stderr.strip().splitlines()[-1][:200] if r.stderr.strip() else "failed"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def _git_commit():
    if os.environ.get("CUBEATTN_COMMIT"):
        return os.environ["CUBEATTN_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              ).stdout.strip() or None
    except Exception:
        return None


def environment(device):
    env = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "commit": _git_commit(),
           "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
           "cubeattn": cubeattn.__version__, "device": device}
    st = cubeattn.backend_status()
    env["backend_status"] = {k: v for k, v in st.items() if k != "devices"}
    env["gpus"] = st["devices"]
    t = _torch()
    if t is not None:
        env["torch"] = t.__version__
        if device == "cuda" and t.cuda.is_available():
            env["gpu_name"] = t.cuda.get_device_name(0)
    return env


# ---------------------------------------------------------------- CPU

def naive_numpy(q, k, v, causal):
    """What a user writes without a kernel: materialise the scores per head (float32)."""
    s_q, h, d = q.shape
    g = h // k.shape[1]
    out = np.empty_like(q)
    for hh in range(h):
        s = (q[:, hh] @ k[:, hh // g].T) * (1.0 / math.sqrt(d))
        if causal:
            s = np.where(np.tri(s_q, k.shape[0], k.shape[0] - s_q, dtype=bool), s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        out[:, hh] = (s / s.sum(-1, keepdims=True)) @ v[:, hh // g]
    return out


def bench_cpu(args):
    """Each implementation runs over all lengths before the next starts: torch's OpenMP threads
    keep spinning for a while after a call and would otherwise steal cores from the next one.
    `fwdbwd`: forward + backward (ours: forward with the LSE, then the deterministic backward,
    numpy arrays; torch: SDPA forward, then `.backward`), what "dense_causal_fwdbwd"."""
    grad = args.what == "fwdbwd"
    hq, hkv, d = CONFIGS[args.config]
    rng = np.random.default_rng(0)
    inputs = {}
    for s in args.seqlens:
        inputs[s] = tuple(rng.standard_normal((s, h, d), dtype=np.float32) for h in (hq, hkv, hkv))

    def flops(s):
        return (3.5 if grad else 1) * 4 * d * hq * (causal_pairs(s, s) if args.causal else s * s)

    what = ("dense_causal_fwdbwd" if args.causal else "dense_fwdbwd") if grad else "dense_fwd"

    def row(impl, s, ms, **kw):
        return dict(what=what, impl=impl, S=s, ms=ms[0], ms_min=ms[1], ms_max=ms[2],
                    gflops=flops(s) / ms[0] / 1e6, **kw)

    rows = []
    for s, (q, k, v) in inputs.items():
        cu = np.array([0, s], np.int32)
        if grad:
            dout = rng.standard_normal(q.shape, dtype=np.float32)

            def step():
                o, lse = cubeattn.flash_attn_varlen_func(q, k, v, cu, cu, s, s, causal=args.causal, return_lse=True,
                                                         device="cpu")
                cubeattn.flash_attn_varlen_backward(dout, q, k, v, o, lse, cu, cu, s, s, causal=args.causal,
                                                    deterministic=True, device="cpu")
            ms = median_ms(step, 1, args.iterations)
        else:
            ms = median_ms(lambda: cubeattn.flash_attn_varlen_func(q, k, v, cu, cu, s, s, causal=args.causal,
                                                                   device="cpu"), 1, args.iterations)
        rows.append(row("cubeattn_cpu", s, ms))
    if _has_torch():
        # in a child process: a process that has imported torch runs other thread pools slower
        for s in inputs:
            res = _torch_cpu_peer(s, hq, hkv, d, args.causal, args.iterations, grad)
            if "error" in res:
                rows.append(dict(what=what, impl="torch_sdpa_cpu", S=s, error=res["error"]))
            else:
                rows.append(row("torch_sdpa_cpu", s, res["ms"], threads=res["threads"]))
    for s, (q, k, v) in inputs.items():
        if s <= args.naive_max and not grad:
            ms = median_ms(lambda: naive_numpy(q, k, v, args.causal), 0, max(1, min(3, args.iterations)))
            rows.append(row("naive_numpy", s, ms))
    return rows


# ---------------------------------------------------------------- CUDA

def _cuda_dense(args, torch):
    """Forward at one config over args.seqlens: cubeattn through the torch call path
    (`flash_attn_func` on [B, S, H, D] CUDA tensors, what a user calls: `impl: cubeattn`), its
    kernels alone (`cubeattn_kernel`), and SDPA's flash and cuDNN backends on the same tensors, the
    three torch calls timed in turns (`interleaved_ms`). B = `--batch-size` (default 1): B
    sequences of S tokens."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hq, hkv, d = CONFIGS[args.config]
    dv = V_HEAD_DIMS.get(args.config, d)
    B = args.batch_size or 1
    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    rows = []
    sync = torch.cuda.synchronize
    for s in args.seqlens:
        flops = B * 2 * (d + dv) * hq * (causal_pairs(s, s) if args.causal else s * s)
        key = dict(what="dense_fwd", config=args.config, causal=args.causal, dtype=args.dtype, B=B, S=s, D=d,
                   **({"Dv": dv} if dv != d else {}))

        def row(impl, ms):
            rows.append(dict(key, impl=impl, ms=ms[0], ms_min=ms[1], ms_max=ms[2], tflops=flops / ms[0] / 1e9))

        cu = [i * s for i in range(B + 1)]
        spec = cubeattn.varlen_spec((B * s, hq, d), (B * s, hkv, d), args.dtype, cu, cu, s, s, causal=args.causal,
                                    v_shape=(B * s, hkv, dv))
        q = torch.randn(B, s, hq, d, device="cuda", dtype=tdt)
        k = torch.randn(B, s, hkv, d, device="cuda", dtype=tdt)
        v = torch.randn(B, s, hkv, dv, device="cuda", dtype=tdt)
        try:
            row("cubeattn_kernel", _spread(cubeattn._core.cuda_bench_forward(spec, 3, args.iterations)))
        except Exception as e:
            rows.append(dict(key, impl="cubeattn_kernel", error=str(e)[:200]))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def sdpa(be):
            def run():
                with sdpa_kernel(be):
                    F.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal, enable_gqa=True)
            return run
        # the torch calls timed in turns (`interleaved_ms`)
        steps = [("cubeattn", lambda: cubeattn.flash_attn_func(q, k, v, causal=args.causal)),
                 ("sdpa_flash", sdpa(SDPBackend.FLASH_ATTENTION)), ("sdpa_cudnn", sdpa(SDPBackend.CUDNN_ATTENTION))]
        _rows_in_turns(steps, args.iterations, sync, row, lambda impl, e: rows.append(dict(key, impl=impl, error=str(e)[:200])))
        del q, k, v, qt, kt, vt
    return rows


def zigzag_cases(quick):
    cases = [(16384, 2), (32768, 4), (65536, 8)]
    return cases[:1] if quick else cases


def _kernel_row(rows, key, impl, flops, bench, spec, iterations):
    """Appends the row of our kernels alone (`bench`: cuda_bench_forward or
    cuda_bench_forward_backward; device-resident inputs, CUDA events), or its error row."""
    try:
        ts = sorted(bench(spec, 3, iterations))
        ms = ts[len(ts) // 2]
        rows.append(dict(key, impl=impl, ms=ms, tflops=flops / ms / 1e9))
    except Exception as e:  # report, keep the peers
        rows.append(dict(key, impl=impl, error=str(e)[:200]))


def _timed_row(rows, key, impl, flops, fn, iterations, sync):
    """Appends the row of `fn` timed by median_ms (synced after each call), or its error row."""
    try:
        ms = median_ms(fn, 3, iterations, sync)
        rows.append(dict(key, impl=impl, ms=ms[0], tflops=flops / ms[0] / 1e9))
    except Exception as e:  # report, keep the peers
        rows.append(dict(key, impl=impl, error=str(e)[:200]))


_ZigzagRank = collections.namedtuple("_ZigzagRank", "C ends q_ranges kv_ranges spec flops")


def _zigzag_rank(T, W, r, hq, hkv, d, dtype, grad):
    """One zigzag rank's grouped call: its two query chunks of C = T / 2W rows, [0, C) and [C, 2C),
    over keys [0, (r + 1) C) and [0, (2W - r) C), bottom-right causal; its FLOPs (`grad`: forward
    + backward, 3.5 x the forward's)."""
    C = T // (2 * W)
    ends = [(r + 1) * C, (2 * W - r) * C]
    q_ranges, kv_ranges = [[0, C], [C, 2 * C]], [[0, e] for e in ends]
    spec = cubeattn.grouped_spec((2 * C, hq, d), (T, hkv, d), dtype, q_ranges, kv_ranges, causal=True)
    flops = (3.5 if grad else 1) * 4 * d * hq * sum(causal_pairs(C, e) for e in ends)
    return _ZigzagRank(C, ends, q_ranges, kv_ranges, spec, flops)


def _zigzag_ours(rows, key, zz, T, hq, hkv, d, args, torch, grad):
    """cubeattn's rows of one zigzag rank `zz` (`grad`: forward + backward): `cubeattn`, what a
    user calls, `grouped_flash_attn_func` on CUDA tensors q [2C, hq, d], k, v [T, hkv, d] (with
    `grad`: then `.backward` of its output), each call synced: everything the user pays, the
    ranges' validation included; `cubeattn_kernel`, the one grouped launch alone (device-resident
    inputs, CUDA events); `cubeattn_kernel_two_calls`, our kernels called once per group (the sum
    of the two calls' medians)."""
    why = cubeattn._core.cuda_refusal(zz.spec, grad, False, "cuda:0")
    if why:  # no CUDA kernel: the torch path would run on the CPU, which is no row
        rows.append(dict(key, impl="cubeattn", error=why[:200]))
    else:
        tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
        q = torch.randn(2 * zz.C, hq, d, device="cuda", dtype=tdt, requires_grad=grad)
        k, v = (torch.randn(T, hkv, d, device="cuda", dtype=tdt, requires_grad=grad) for _ in range(2))
        go = torch.randn_like(q) if grad else None

        def ours():
            o = cubeattn.grouped_flash_attn_func(q, k, v, zz.q_ranges, zz.kv_ranges, causal=True)
            if grad:
                o.backward(go)
        _timed_row(rows, key, "cubeattn", zz.flops, ours, args.iterations, torch.cuda.synchronize)
        del q, k, v, go
    bench = cubeattn._core.cuda_bench_forward_backward if grad else cubeattn._core.cuda_bench_forward
    _kernel_row(rows, key, "cubeattn_kernel", zz.flops, bench, zz.spec, args.iterations)
    try:
        per = 0.0
        for e in zz.ends:
            sp = cubeattn.varlen_spec((zz.C, hq, d), (e, hkv, d), args.dtype, [0, zz.C], [0, e], zz.C, e, causal=True)
            ts = sorted(bench(sp, 3, args.iterations))
            per += ts[len(ts) // 2]
        rows.append(dict(key, impl="cubeattn_kernel_two_calls", ms=per, tflops=zz.flops / per / 1e9))
    except Exception as e:
        rows.append(dict(key, impl="cubeattn_kernel_two_calls", error=str(e)[:200]))


def _compiled_flex(torch):
    """FlexAttention compiled with static shapes, with room for every shape of a run: past
    dynamo's recompile limit (8 by default) a call falls back to the unfused implementation, which
    materialises the score matrix (slow, and out of memory at Llama3-70B heads): not the peer a
    user runs."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 1024))
    return torch.compile(flex_attention, dynamic=False)


def _cuda_grouped(args, torch):
    """Grouped attention forward, peers in the same process on the same shapes: rows `zigzag_fwd`
    (keys config, T, W, rank: one zigzag rank's two query chunks, see _zigzag_rank) with impl
    `cubeattn` (the torch call path), `cubeattn_kernel`, `cubeattn_kernel_two_calls` (see
    _zigzag_ours), `sdpa_flash_two_calls` (SDPA flash once per chunk), `cudnn_split_merge` and
    `flex_one_call` (FlexAttention, one call with a block mask); then `shared_prefix_fwd` (G groups
    over a shared prefix: `cubeattn_grouped`, our kernels alone, beside `sdpa_flash_per_group` and
    `flex_one_call`)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    try:
        from torch.nn.attention.flex_attention import create_block_mask
        flex = _compiled_flex(torch)
    except Exception:
        flex = None
    from . import _lse_split

    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    sync = torch.cuda.synchronize
    # the cuDNN peer of a bottom-right causal chunk: the causal square and the non-causal prefix,
    # merged by their LSE (`cudnn_split_merge`, as the zigzag bench's `allgather_cudnn`)
    split_op = _lse_split.CudnnOp()

    def cudnn_split_merge(qq, kk, vv):
        return _lse_split.lower_right_causal(qq, kk, vv, split_op)
    rows = []
    for cfg in args.configs:
        hq, hkv, d = CONFIGS[cfg]
        for T, W in zigzag_cases(args.quick):
            for r in (0, W - 1):
                zz = _zigzag_rank(T, W, r, hq, hkv, d, args.dtype, grad=False)
                C, ends, flops = zz.C, zz.ends, zz.flops
                key = dict(what="zigzag_fwd", config=cfg, T=T, W=W, rank=r)
                _zigzag_ours(rows, key, zz, T, hq, hkv, d, args, torch, grad=False)
                qs = [torch.randn(1, hq, C, d, device="cuda", dtype=tdt) for _ in ends]
                k = torch.randn(1, hkv, T, d, device="cuda", dtype=tdt)
                v = torch.randn_like(k)

                def two_calls():
                    for qq, e in zip(qs, ends):
                        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                            F.scaled_dot_product_attention(qq, k[:, :, :e], v[:, :, :e],
                                                           attn_mask=causal_lower_right(C, e), enable_gqa=True)
                _timed_row(rows, key, "sdpa_flash_two_calls", flops, two_calls, args.iterations, sync)
                try:
                    ms = median_ms(lambda: [cudnn_split_merge(qq, k[:, :, :e], v[:, :, :e]) for qq, e in zip(qs, ends)],
                                   3, args.iterations, sync)
                    # the peer computes the same attention: its largest difference from SDPA flash's
                    # bottom-right causal output, relative to that output's largest magnitude
                    qq, e = qs[-1], ends[-1]
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        want = F.scaled_dot_product_attention(qq, k[:, :, :e], v[:, :, :e], attn_mask=causal_lower_right(C, e),
                                                              enable_gqa=True).float()
                    got = cudnn_split_merge(qq, k[:, :, :e], v[:, :, :e]).float()
                    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
                    rows.append(dict(key, impl="cudnn_split_merge", ms=ms[0], tflops=flops / ms[0] / 1e9, max_rel_vs_flash=err))
                except Exception as e:
                    rows.append(dict(key, impl="cudnn_split_merge", error=str(e)[:200]))
                if flex is not None:
                    try:
                        qcat = torch.cat(qs, 2)
                        e0, e1 = ends

                        def gmask(b, h, qi, ki):
                            return ki <= torch.where(qi < C, e0 - C + qi, e1 - C + (qi - C))
                        bm = create_block_mask(gmask, None, None, 2 * C, T, device="cuda")
                        ms = median_ms(lambda: flex(qcat, k, v, block_mask=bm, enable_gqa=True), 3, args.iterations, sync)
                        rows.append(dict(key, impl="flex_one_call", ms=ms[0], tflops=flops / ms[0] / 1e9))
                    except Exception as e:
                        rows.append(dict(key, impl="flex_one_call", error=str(e)[:200]))
                del qs, k, v
    # shared prefix: G groups of Qg queries, group g sees keys [0, P - 256 g), non-causal
    P, G, Qg = (8192, 8, 8) if args.quick else (32768, 32, 8)
    hq, hkv, d = CONFIGS["llama3-8b"]
    ends = [P - 256 * g for g in range(G)]
    flops = 4 * d * hq * Qg * sum(ends)
    key = dict(what="shared_prefix_fwd", P=P, G=G, Qg=Qg)
    spec = cubeattn.grouped_spec((G * Qg, hq, d), (P, hkv, d), args.dtype, [[g * Qg, (g + 1) * Qg] for g in range(G)],
                                 [[0, e] for e in ends], causal=False)
    _kernel_row(rows, key, "cubeattn_grouped", flops, cubeattn._core.cuda_bench_forward, spec, args.iterations)
    k = torch.randn(1, hkv, P, d, device="cuda", dtype=tdt)
    v = torch.randn_like(k)
    qs = [torch.randn(1, hq, Qg, d, device="cuda", dtype=tdt) for _ in range(G)]

    def sep():
        for qq, e in zip(qs, ends):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                F.scaled_dot_product_attention(qq, k[:, :, :e], v[:, :, :e], enable_gqa=True)
    ms = median_ms(sep, 3, args.iterations, sync)
    rows.append(dict(key, impl="sdpa_flash_per_group", ms=ms[0], tflops=flops / ms[0] / 1e9))
    if flex is not None:
        try:
            qcat = torch.cat(qs, 2)
            endt = torch.tensor(ends, device="cuda")

            def pm(b, h, qi, ki):
                return ki < endt[qi // Qg]
            bm = create_block_mask(pm, None, None, G * Qg, P, device="cuda")
            ms = median_ms(lambda: flex(qcat, k, v, block_mask=bm, enable_gqa=True), 3, args.iterations, sync)
            rows.append(dict(key, impl="flex_one_call", ms=ms[0], tflops=flops / ms[0] / 1e9))
        except Exception as e:
            rows.append(dict(key, impl="flex_one_call", error=str(e)[:200]))
    kv_bytes_once = 2 * P * hkv * d * 2
    rows.append(dict(key, impl="kv_bytes", grouped_bytes=kv_bytes_once, separate_bytes=2 * sum(ends) * hkv * d * 2))
    return rows


def _cuda_fwdbwd(args, torch):
    """Forward + backward (a training step) through torch autograd, peers in the same process:
    rows `dense_fwdbwd` (keys config, S, D, causal; impl cubeattn = `flash_attn_func(...)
    .backward(g)`, cubeattn_deterministic the same with deterministic=True, cubeattn_kernel the
    kernels alone with device-resident inputs, sdpa_cudnn, sdpa_flash; the four torch steps timed
    in turns, `interleaved_ms`) for `--config` (default:
    llama3-8b and gqa-d64), B = `--batch-size` sequences (default 1; key B), causal and not
    (`--no-causal`: only not), then (unless --dense-only) the
    grouped zigzag rows `zigzag_fwdbwd` of the first config (keys config, T, W, rank; impl cubeattn,
    cubeattn_kernel, cubeattn_kernel_two_calls as in _zigzag_ours, sdpa_flash_two_calls,
    cudnn_split_merge: cuDNN on each chunk's causal square and non-causal prefix, merged by LSE,
    `_lse_split`).
    FLOPs = 3.5 x the forward matmul FLOPs."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    from . import _lse_split

    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    sync = torch.cuda.synchronize
    split_op = _lse_split.CudnnOp()
    rows = []
    configs = [args.config] if args.config else ["llama3-8b", "gqa-d64"]
    seqlens = args.seqlens if args.seqlens_given else ([8192] if args.quick else [4096, 8192, 16384, 32768])
    B = args.batch_size or 1
    for config in configs:
        hq, hkv, d = CONFIGS[config]
        dv = V_HEAD_DIMS.get(config, d)
        for causal in ([True, False] if args.causal else [False]):
            for s in seqlens:
                pairs = causal_pairs(s, s) if causal else s * s
                flops = B * 3.5 * 2 * (d + dv) * hq * pairs
                key = dict(what="dense_fwdbwd", config=config, B=B, S=s, D=d, causal=causal,
                           **({"Dv": dv} if dv != d else {}))
                cu = [i * s for i in range(B + 1)]
                spec = cubeattn.varlen_spec((B * s, hq, d), (B * s, hkv, d), args.dtype, cu, cu, s, s, causal=causal,
                                            v_shape=(B * s, hkv, dv))
                _kernel_row(rows, key, "cubeattn_kernel", flops, cubeattn._core.cuda_bench_forward_backward, spec,
                            args.iterations)
                q = torch.randn(B, s, hq, d, device="cuda", dtype=tdt, requires_grad=True)
                k = torch.randn(B, s, hkv, d, device="cuda", dtype=tdt, requires_grad=True)
                v = torch.randn(B, s, hkv, dv, device="cuda", dtype=tdt, requires_grad=True)
                go = torch.randn(B, s, hq, dv, device="cuda", dtype=tdt)
                q4, k4, v4 = (x.detach().transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k, v))
                go4 = go.transpose(1, 2).contiguous()

                def ours(det):
                    return lambda: cubeattn.flash_attn_func(q, k, v, causal=causal, deterministic=det).backward(go)

                def sdpa(be):
                    def step():
                        with sdpa_kernel(be):
                            o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal, enable_gqa=True)
                        o.backward(go4)
                    return step
                steps = []
                for impl, det in (("cubeattn", False), ("cubeattn_deterministic", True)):
                    why = cubeattn._core.cuda_refusal(spec, True, det, "cuda:0")
                    if why:
                        # no CUDA kernel (e.g. deterministic above head_dim 128): a CPU run is no row
                        rows.append(dict(key, impl=impl, error=why[:200]))
                    else:
                        steps.append((impl, ours(det)))
                steps += [("sdpa_cudnn", sdpa(SDPBackend.CUDNN_ATTENTION)), ("sdpa_flash", sdpa(SDPBackend.FLASH_ATTENTION))]
                # the torch steps timed in turns (`interleaved_ms`)
                _rows_in_turns(steps, args.iterations, sync,
                               lambda impl, ms: rows.append(dict(key, impl=impl, ms=ms[0], tflops=flops / ms[0] / 1e9)),
                               lambda impl, e: rows.append(dict(key, impl=impl, error=str(e)[:200])))
                del q, k, v, go, q4, k4, v4, go4
    hq, hkv, d = CONFIGS[configs[0]]
    for T, W in ([] if args.dense_only else zigzag_cases(args.quick)):
        for r in (0, W - 1):
            zz = _zigzag_rank(T, W, r, hq, hkv, d, args.dtype, grad=True)
            C, ends = zz.C, zz.ends
            key = dict(what="zigzag_fwdbwd", config=configs[0], T=T, W=W, rank=r)
            _zigzag_ours(rows, key, zz, T, hq, hkv, d, args, torch, grad=True)
            qs = [torch.randn(1, hq, C, d, device="cuda", dtype=tdt, requires_grad=True) for _ in ends]
            k = torch.randn(1, hkv, T, d, device="cuda", dtype=tdt, requires_grad=True)
            v = torch.randn(1, hkv, T, d, device="cuda", dtype=tdt, requires_grad=True)
            go = torch.randn(1, hq, C, d, device="cuda", dtype=tdt)

            def two_calls():
                for qq, e in zip(qs, ends):
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        o = F.scaled_dot_product_attention(qq, k[:, :, :e], v[:, :, :e],
                                                           attn_mask=causal_lower_right(C, e), enable_gqa=True)
                    o.backward(go)
            _timed_row(rows, key, "sdpa_flash_two_calls", zz.flops, two_calls, args.iterations, sync)

            def cudnn_split_merge():
                # per chunk the causal square and the non-causal prefix by cuDNN, merged by their
                # LSE; the backward runs cuDNN's on each part with the merged out and LSE (exact)
                for qq, e in zip(qs, ends):
                    _lse_split.lower_right_causal(qq, k[:, :, :e], v[:, :, :e], split_op).backward(go)
            _timed_row(rows, key, "cudnn_split_merge", zz.flops, cudnn_split_merge, args.iterations, sync)
            del qs, k, v, go
    return rows


def _cuda_autograd(args, torch):
    """A training step through torch autograd (out = attention(q, k, v); out.backward(g)) on CUDA
    tensors: cubeattn device-resident, cubeattn with host copies (CUBEATTN_TORCH_HOST_COPY=1), and
    SDPA flash; the step's FLOPs counted as 3.5 x the forward's."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    hq, hkv, d = CONFIGS[args.config]
    rows = []
    for s in (args.seqlens if args.seqlens_given else ([8192] if args.quick else [4096, 8192])):
        flops = 3.5 * 4 * d * hq * causal_pairs(s, s)
        key = dict(what="autograd_step", config=args.config, S=s)
        q = torch.randn(s, hq, d, device="cuda", dtype=tdt, requires_grad=True)
        k = torch.randn(s, hkv, d, device="cuda", dtype=tdt, requires_grad=True)
        v = torch.randn(s, hkv, d, device="cuda", dtype=tdt, requires_grad=True)
        g = torch.randn(s, hq, d, device="cuda", dtype=tdt)
        cu = torch.tensor([0, s], dtype=torch.int32)

        def ours():
            cubeattn.flash_attn_varlen_func(q, k, v, cu, cu, s, s, causal=True, deterministic=True).backward(g)
        for impl, host in (("cubeattn_device", "0"), ("cubeattn_host_copy", "1")):
            os.environ["CUBEATTN_TORCH_HOST_COPY"] = host
            try:
                ms = median_ms(ours, 2, args.iterations, torch.cuda.synchronize)
                rows.append(dict(key, impl=impl, ms=ms[0], tflops=flops / ms[0] / 1e9))
            except Exception as e:
                rows.append(dict(key, impl=impl, error=str(e)[:200]))
        os.environ.pop("CUBEATTN_TORCH_HOST_COPY", None)
        q4, k4, v4 = (x.detach().transpose(0, 1).unsqueeze(0).requires_grad_(True) for x in (q, k, v))
        g4 = g.transpose(0, 1).unsqueeze(0)

        def sdpa():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True).backward(g4)
        ms = median_ms(sdpa, 2, args.iterations, torch.cuda.synchronize)
        rows.append(dict(key, impl="sdpa_flash", ms=ms[0], tflops=flops / ms[0] / 1e9))
        del q, k, v, g, q4, k4, v4, g4
    return rows


def _wall_ms(fn, torch, calls=20, rounds=5):
    """What a user feels: `calls` back-to-back calls, one device sync at the end, per-call ms
    (median over `rounds`)."""
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e3 / calls)
    ts.sort()
    return ts[len(ts) // 2]


_FIRST_CALL = """
import os, sys, time, json
t0 = time.perf_counter()
import torch, cubeattn
q = torch.randn(1, 1024, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(1, 1024, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(1, 1024, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
# torch's own first autograd backward (engine threads, its kernels) outside the timed region,
# with an explicit gradient tensor as below: torch imports torch.fx.experimental.symbolic_shapes
# (and sympy) on the first such call, seconds that are torch's, not the attention's
w = q.float() + k.float().sum() + v.float().sum()
w.backward(torch.ones_like(w))
q.grad = k.grad = v.grad = None
torch.cuda.synchronize()
t1 = time.perf_counter()
out = cubeattn.flash_attn_func(q, k, v, causal=True)
torch.cuda.synchronize()
t2 = time.perf_counter()
out.backward(torch.ones_like(out))
torch.cuda.synchronize()
t3 = time.perf_counter()
print(json.dumps({"forward": (t2 - t1) * 1e3, "backward": (t3 - t2) * 1e3}))
"""


def _first_call(torch):
    """First forward and backward call in a fresh process: with an empty kernel cache (cold) and
    again with the cache the first process filled (warm)."""
    import subprocess
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, CUBEATTN_CACHE_DIR=cache, CUBEATTN_TRACE="1")
        for state in ("cold", "warm"):
            r = subprocess.run([sys.executable, "-c", _FIRST_CALL], env=env, capture_output=True, text=True)
            if r.returncode != 0:
                rows.append(dict(what="first_call", impl="cubeattn", cache=state, error=r.stderr[-200:]))
                continue
            t = json.loads(r.stdout.strip().splitlines()[-1])
            loads = [ln for ln in r.stderr.splitlines() if ln.startswith("cubeattn kernel")]
            for ln in loads:
                print(f"# first call ({state} cache): {ln}")
            for part in ("forward", "backward"):
                rows.append(dict(what="first_call", impl="cubeattn", cache=state, part=part, B=1, S=1024, ms=t[part],
                                 compiled=sum("compiled" in ln for ln in loads)))
    return rows


def _cuda_callpath(args, torch):
    """The torch call path as a user feels it (bf16, heads of --config): wall clock over 20 calls
    with one sync at the end, beside the kernels' own GPU time (CUDA events) and SDPA flash /
    cuDNN in the same process: a small causal forward (B=4, S=1K), a decode step (B=8, one query
    over 4K keys), long forwards; the per-call host overhead on a tiny shape; the first call in a
    fresh process with a cold and a warm kernel cache."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    hq, hkv, d = CONFIGS[args.config]
    rows = []
    # (what, B, Sq, Sk, causal); a single query sees every key, so decode is non-causal for both
    for what, b, sq, sk, causal in (("small_causal_fwd", 4, 1024, 1024, True), ("decode_fwd", 8, 1, 4096, False),
                                    ("forward", 1, 8192, 8192, True), ("fwdbwd", 1, 8192, 8192, True),
                                    ("host_overhead", 1, 128, 128, True), ("host_overhead_fwdbwd", 1, 128, 128, True)):
        grad = what in ("fwdbwd", "host_overhead_fwdbwd")
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=tdt, requires_grad=grad)
        k = torch.randn(b, sk, hkv, d, device="cuda", dtype=tdt, requires_grad=grad)
        v = torch.randn(b, sk, hkv, d, device="cuda", dtype=tdt, requires_grad=grad)
        g = torch.randn(b, sq, hq, d, device="cuda", dtype=tdt)
        key = dict(what=what, config=args.config, B=b, S=sq) if sq == sk else \
            dict(what=what, config=args.config, B=b, Sq=sq, Sk=sk)
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(grad) for x in (q, k, v))
        gt = g.transpose(1, 2).contiguous()

        def ours():
            o = cubeattn.flash_attn_func(q, k, v, causal=causal)
            if grad:
                o.backward(g)

        def sdpa(backend):
            def f():
                with sdpa_kernel(backend):
                    o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True)
                    if grad:
                        o.backward(gt)
            return f
        tiny = what.startswith("host_overhead")
        calls = 200 if tiny else 20
        rows.append(dict(key, impl="cubeattn", ms=_wall_ms(ours, torch, calls)))
        if what == "decode_fwd":  # the same step through flash-attn's decoding call (no append)
            rows.append(dict(key, impl="cubeattn_kvcache", ms=_wall_ms(
                lambda: cubeattn.flash_attn_with_kvcache(q, k, v, cache_seqlens=sk), torch, calls)))
            # cache_seqlens as an int32 CUDA tensor, as flash-attn's decode loops pass it
            sk_dev = torch.full((b,), sk, dtype=torch.int32, device=q.device)
            rows.append(dict(key, impl="cubeattn_kvcache_cuda_seqlens", ms=_wall_ms(
                lambda: cubeattn.flash_attn_with_kvcache(q, k, v, cache_seqlens=sk_dev), torch, calls)))
        if tiny:
            # SDPA flash on the same tiny shape: the peer's own per-call cost
            rows.append(dict(key, impl="sdpa_flash", ms=_wall_ms(sdpa(SDPBackend.FLASH_ATTENTION), torch, calls)))
        else:
            cu_q, cu_k = (np.arange(b + 1, dtype=np.int32) * n for n in (sq, sk))
            spec = cubeattn.varlen_spec((b * sq, hq, d), (b * sk, hkv, d), args.dtype, cu_q, cu_k, sq, sk, None,
                                        causal)
            bench = cubeattn._core.cuda_bench_forward_backward if grad else cubeattn._core.cuda_bench_forward
            ts = sorted(bench(spec, 3, 20))
            rows.append(dict(key, impl="cubeattn_kernels", ms=ts[len(ts) // 2]))
            for impl, be in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                try:
                    rows.append(dict(key, impl=impl, ms=_wall_ms(sdpa(be), torch, calls)))
                except Exception as e:
                    rows.append(dict(key, impl=impl, error=str(e)[:200]))
        del q, k, v, g, qt, kt, vt, gt
    rows.extend(_first_call(torch))
    return rows


# ---------------------------------------------------------------- context parallel (torchrun)

def _dist_setup(torch, device):
    """Joins (or starts) the torchrun process group: NCCL with one GPU per rank, gloo on the CPU."""
    import torch.distributed as dist

    if not dist.is_initialized():
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if "RANK" not in os.environ:  # plain `python -m cubeattn.bench zigzag`: one rank
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return dist


class _NoComm:
    """Replaces the collectives of cubeattn.zigzag (and the baseline's) by local stand-ins while
    active: the same step without communication, to measure how much of it is exposed. The
    all-gather's stand-in copies the local slice into every rank's place (`fill`): left unwritten,
    the gathered K,V would be whatever memory the allocator handed out (zeros, or NaN patterns
    that send the forward to its exact non-finite kernel: 3.9 s instead of 98 ms once), so the
    kernels would not see the data of a real step. The copy is local HBM traffic, so the exposed
    figure is understated by at most its time (the gathered bytes at copy bandwidth)."""

    active = False

    @staticmethod
    def fill(out, inp):
        w = out.shape[0] // inp.shape[0]
        out.view((w,) + tuple(inp.shape)).copy_(inp.unsqueeze(0).expand((w,) + tuple(inp.shape)))


def _allgather_kv(torch, dist):
    """The baseline's differentiable all-gather: forward all_gather_into_tensor, backward
    reduce_scatter_tensor of the gradient (summing every rank's contribution)."""

    class AllGather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            w = dist.get_world_size()
            out = torch.empty((w * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
            if _NoComm.active:
                _NoComm.fill(out, x.contiguous())
            else:
                if dist.get_backend() == "nccl":
                    dist.all_gather_into_tensor(out, x.contiguous())
                else:
                    dist.all_gather(list(out.chunk(w, 0)), x.contiguous())
            return out

        @staticmethod
        def backward(ctx, g):
            w = dist.get_world_size()
            g = g.contiguous()
            out = torch.empty((g.shape[0] // w,) + tuple(g.shape[1:]), dtype=g.dtype, device=g.device)
            if _NoComm.active:
                return out.copy_(g[:out.shape[0]])
            if dist.get_backend() == "nccl":
                dist.reduce_scatter_tensor(out, g)
            else:
                dist.all_reduce(g)
                r = dist.get_rank()
                out.copy_(g[r * out.shape[0]:(r + 1) * out.shape[0]])
            return out

    return AllGather.apply


def _cp_zigzag(args, torch, device):
    """Per-GPU step times of zigzag context parallelism (one sequence of W x T tokens; each rank
    holds T): cubeattn's layer beside two all-gather baselines in the same processes, all-gather
    K,V + per local chunk one SDPA flash call with the bottom-right causal mask
    (``allgather_sdpa_flash``), or the causal square + the non-causal prefix on cuDNN merged by
    log-sum-exp (``allgather_cudnn``; cuDNN has no bottom-right mask for Sq != Sk; on the CPU the
    same split runs on torch's CPU flash op: ``allgather_lse_split_cpu``), + reduce-scatter of dK,
    dV in the backward. Every time is the max over ranks of the per-rank median; `*_nocomm` repeats
    the step with the collectives replaced by local stand-ins, and exposed communication = step -
    step without collectives. ``tflops_per_gpu``: the fwd+bwd step's attention FLOPs (3.5x the
    forward's, causal pairs only) per GPU per second; ``fwd_tflops_per_gpu`` the forward's.
    ``rel_err_vs_cubeattn`` (baselines): the largest relative difference of out, dq, dk, dv from
    cubeattn's over the ranks, from one fwd+bwd step before the timing. ``--window L`` adds
    cubeattn with the causal sliding window (L, 0) (``impl: cubeattn_window``, its FLOPs those of
    the window's pairs)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    from . import _lse_split
    from . import zigzag as zz

    dist = _dist_setup(torch, device)
    w, rank = dist.get_world_size(), dist.get_rank()
    hq, hkv, d = CONFIGS[args.config]
    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype] if device == "cuda" else torch.float32
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    sync = torch.cuda.synchronize if device == "cuda" else _no_sync
    stride = args.heads_k_stride or hkv
    real_gather, real_rs = zz._all_gather, zz._reduce_scatter

    def gather(out, inp, group):
        if _NoComm.active:
            _NoComm.fill(out, inp)
        else:
            real_gather(out, inp, group)

    def rs(out, inp, group):
        if not _NoComm.active:
            real_rs(out, inp, group)
    zz._all_gather, zz._reduce_scatter = gather, rs
    ag = _allgather_kv(torch, dist)

    def sdpa_flash(qc, kc, vc):
        ctx = sdpa_kernel(SDPBackend.FLASH_ATTENTION) if device == "cuda" else sdpa_kernel(SDPBackend.MATH)
        with ctx:
            return F.scaled_dot_product_attention(qc, kc, vc, attn_mask=causal_lower_right(qc.shape[2], kc.shape[2]),
                                                  enable_gqa=True)

    split_op = _lse_split.CudnnOp() if device == "cuda" else _lse_split.CpuFlashOp()

    def lse_split(qc, kc, vc):
        return _lse_split.lower_right_causal(qc, kc, vc, split_op)

    rows = []
    try:
        for tg in args.seqlens:
            T = w * tg
            C = tg // 2
            if tg % 2:
                raise SystemExit(f"--seqlens: tokens per GPU must be even, got {tg}")
            ends = [(rank + 1) * C, (2 * w - rank) * C]
            fwd_flops = 4 * d * hq * sum(causal_pairs(C, e) for e in ends)
            # the pairs of the causal window (L, 0): position p sees min(p + 1, L + 1) keys
            win_flops = 4 * d * hq * sum(int(np.minimum(np.arange(e - C, e) + 1, args.window + 1).sum())
                                         for e in ends) if args.window is not None else None
            gen = torch.Generator().manual_seed(rank)
            q, k, v, go = (torch.randn(tg, h, d, generator=gen).to(tdt).to(dev) for h in (hq, hkv, hkv, hq))
            q, k, v = (x.requires_grad_() for x in (q, k, v))
            cu = np.array([0, T], np.int32)
            lcu = zz.zigzag_cu_seqlens(cu, w)
            nat = torch.from_numpy(zz._core.zigzag_gathered_rows(cu, w, 2 * w - 1)).to(dev)

            def layer(window):
                def step(backward):
                    o = zz.zigzag_llama3_flash_attn_varlen_func(q, k, v, lcu, lcu, tg, tg, stride, causal=True,
                                                                window_size=window,
                                                                keep_gathered_kv=args.keep_gathered_kv)
                    if backward:
                        o.backward(go)
                    return o
                return step

            def allgather(attend):
                """All-gather K,V (in original order), `attend` each local chunk over its causal prefix."""
                def step(backward):
                    kg, vg = (ag(x).index_select(0, nat) for x in (k, v))
                    k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (kg, vg))
                    q4 = q.transpose(0, 1).unsqueeze(0)
                    outs = [attend(q4[:, :, i * C:(i + 1) * C], k4[:, :, :e], v4[:, :, :e]) for i, e in enumerate(ends)]
                    o = torch.cat(outs, 2)[0].transpose(0, 1)
                    if backward:
                        o.backward(go)
                    return o
                return step

            # (impl, step, forward FLOPs, window)
            impls = [("cubeattn", layer((-1, -1)), fwd_flops, None),
                     ("allgather_cudnn" if device == "cuda" else "allgather_lse_split_cpu", allgather(lse_split),
                      fwd_flops, None),
                     ("allgather_sdpa_flash", allgather(sdpa_flash), fwd_flops, None)]
            if args.window is not None:
                impls.append(("cubeattn_window", layer((args.window, 0)), win_flops, args.window))
            base = None
            for impl, fn, flops, window in impls:
                ours = impl.startswith("cubeattn")
                row = dict(what="cp_zigzag", impl=impl, W=w, T=T, T_per_gpu=tg, config=args.config,
                           dtype=str(tdt).replace("torch.", ""), heads_k_stride=stride if ours else None,
                           keep_gathered_kv=args.keep_gathered_kv if ours else None)
                if window is not None:
                    row["window"] = [window, 0]
                try:
                    # one checked step: out and the gradients against cubeattn's (no peer has a window)
                    got = [fn(True).detach()] + [x.grad for x in (q, k, v)]
                    for x in (q, k, v):
                        x.grad = None
                    if base is None:
                        base = got
                    elif window is None:
                        err = max(((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
                                  for a, b in zip(got, base))
                        t = torch.tensor([err], dtype=torch.float64, device=dev)
                        dist.all_reduce(t, op=dist.ReduceOp.MAX)
                        row["rel_err_vs_cubeattn"] = t.item()
                    del got
                    for key, backward in (("fwd", False), ("fwdbwd", True)):
                        for nocomm in (False, True):
                            _NoComm.active = nocomm

                            def step():
                                if backward:
                                    fn(True)
                                else:
                                    with torch.no_grad():
                                        fn(False)
                            dist.barrier()
                            # a fixed number of warm-up steps: every rank makes the same collectives
                            ms = median_ms(step, 2, args.iterations, sync, warm_s=0.0)[0]
                            t = torch.tensor([ms], dtype=torch.float64, device=dev)
                            dist.all_reduce(t, op=dist.ReduceOp.MAX)
                            row[f"{key}_ms" + ("_nocomm" if nocomm else "")] = t.item()
                        _NoComm.active = False
                        row[f"exposed_comm_{key}_ms"] = row[f"{key}_ms"] - row[f"{key}_ms_nocomm"]
                        for x in (q, k, v):
                            x.grad = None
                    row["fwd_tflops_per_gpu"] = flops / row["fwd_ms"] / 1e9
                    row["tflops_per_gpu"] = 3.5 * flops / row["fwdbwd_ms"] / 1e9
                except Exception as e:
                    _NoComm.active = False
                    row["error"] = str(e)[:200]
                rows.append(row)
            del q, k, v, go, base
    finally:
        _NoComm.active = False
        zz._all_gather, zz._reduce_scatter = real_gather, real_rs
    return rows


# ---------------------------------------------------------------- block-sparse (CPU)

def bench_sparse_cpu(args):
    """Dense vs block-sparse forward on the CPU, same inputs, fp32, batch 1. Rows:
    {what: "sparse_fwd", impl: "cubeattn_cpu_dense" | "cubeattn_cpu_sparse" | "cubeattn_cpu_sparse_int8"
    (`--quant_gran`) | "cubeattn_cpu_sparse_int8_fp8" (`--pv-precision fp8`), S, kept, ms}; kept is
    the fraction of key blocks listed per query block (top_k / k_blocks), `ideal` = 1 / kept."""
    from . import sparse_patterns as sp

    hq, hkv, d = CONFIGS[args.config]
    rng = np.random.default_rng(0)
    rows = []
    for s in args.seqlens:
        q, k, v = (rng.standard_normal((1, s, h, d), dtype=np.float32) for h in (hq, hkv, hkv))
        qbn, kbn = -(-s // 64), -(-s // 128)
        dense_flops = 4 * d * hq * (causal_pairs(s, s) if args.causal else s * s)
        ms = median_ms(lambda: cubeattn.flash_attn_func(q, k, v, causal=args.causal, device="cpu"), 1, args.iterations)
        dense_ms = ms[0]
        rows.append(dict(what="sparse_fwd", impl="cubeattn_cpu_dense", S=s, kept=1.0, pattern="dense", causal=args.causal,
                         ms=ms[0], ms_min=ms[1], ms_max=ms[2], gflops=dense_flops / ms[0] / 1e6))
        variants = [("cubeattn_cpu_sparse", None, None)]
        if args.quant_gran:
            variants.append(("cubeattn_cpu_sparse_int8", args.quant_gran, None))
        pv = getattr(args, "pv_precision", None)
        if args.quant_gran and pv:
            variants.append(("cubeattn_cpu_sparse_int8_fp8", args.quant_gran, pv))
        for ratio in args.top_k_ratios:
            top_k = sp.top_k_for(kbn, ratio)
            ix = sp.PATTERNS[args.pattern](1, hq, qbn, kbn, top_k, seed=0)
            spec = cubeattn.sparse_spec((s, hq, d), (s, hkv, d), "float32", [0, s], [0, s], s, s, ix, causal=args.causal)
            for impl, int8, fp8 in variants:
                ms = median_ms(lambda: cubeattn.block_sparse_attn_func(q, k, v, ix, causal=args.causal, device="cpu",
                                                                       quant_gran=int8, pv_precision=fp8),
                               1, args.iterations)
                rows.append(dict(what="sparse_fwd", impl=impl, S=s, kept=round(top_k / kbn, 4), pattern=args.pattern,
                                 causal=args.causal, ms=ms[0], ms_min=ms[1], ms_max=ms[2],
                                 gflops=spec.forward_flops / ms[0] / 1e6, speedup=dense_ms / ms[0],
                                 ideal=kbn / top_k, **({"quant_gran": int8} if int8 else {}),
                                 **({"pv_precision": fp8} if fp8 else {})))
    return rows


# ---------------------------------------------------------------- block-sparse (CUDA)

def _cuda_sparse(args, torch):
    """Block-sparse forward on CUDA vs our dense kernel, SDPA flash (dense) and FlexAttention with
    the same BlockMask; bf16, q_block = k_block = 128 (FlexAttention's block), index per head.
    Wall clock of the torch call (median, one sync per call). Rows: {what: "sparse_fwd", impl:
    "cubeattn" (the public call with the index: validated per call) | "cubeattn_prepared" (the
    public call with a SparseSpec built once, as a FlexAttention BlockMask is) | "cubeattn_int8" (the same
    prepared call with INT8 Q K^T, `--quant_gran`; `cosine` against the bf16 sparse output, `rel_l2` /
    `rel_l2_bf16`: the INT8 / bf16 sparse output against the f64 block-sparse attention of batch 0, 4 heads) |
    "cubeattn_int8_fp8" (with `--pv-precision fp8`: the INT8 call with FP8 P.V, the same columns; an
    error row where the GPU refuses it) | "cubeattn_dense" | "sdpa_flash" | "flex", B, H, S, keep, pattern, causal, ms}.
    Then what "sparse_fwdbwd": one autograd step (out = f(q, k, v); out.backward(g), gradients
    accumulating into the leaves) for cubeattn_prepared and cubeattn_dense (the default
    deterministic=False: dQ fused with atomics), cubeattn_prepared_det and cubeattn_dense_det
    (deterministic=True: the dQ pass), sdpa_flash and flex with the same BlockMask."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from . import sparse_patterns as sp

    B, H, d = args.batch_size or 4, args.num_heads or 32, args.head_dim or 128
    tdt = torch.bfloat16
    sync = torch.cuda.synchronize
    it = args.iterations
    rows = []
    try:
        from torch.nn.attention.flex_attention import BlockMask

        flex = _compiled_flex(torch)
    except Exception as e:  # report, keep the others
        flex = None
        rows.append(dict(what="sparse_fwd", impl="flex", error=str(e)[:200]))
    for s in args.seqlens:
        nb = -(-s // 128)
        q, k, v = (torch.randn(B, s, H, d, device="cuda", dtype=tdt) for _ in range(3))
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        # autograd leaves and the output gradient of the fwd+bwd rows
        qg, kg, vg, qtg, ktg, vtg = (x.detach().requires_grad_(True) for x in (q, k, v, qt, kt, vt))
        g = torch.randn_like(q)
        gt = g.transpose(1, 2).contiguous()
        base = dict(what="sparse_fwd", B=B, H=H, S=s, causal=args.causal)
        fb = dict(base, what="sparse_fwdbwd")
        ms = median_ms(lambda: cubeattn.flash_attn_func(q, k, v, causal=args.causal), 3, it, sync)
        rows.append(dict(base, impl="cubeattn_dense", keep=1.0, pattern="dense", ms=ms[0], ms_min=ms[1]))
        def sdpa(x=(qt, kt, vt), grad=None):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o = F.scaled_dot_product_attention(*x, is_causal=args.causal)
            if grad is not None:
                o.backward(grad)
        ms = median_ms(sdpa, 3, it, sync)
        rows.append(dict(base, impl="sdpa_flash", keep=1.0, pattern="dense", ms=ms[0], ms_min=ms[1]))
        for det, name in ((False, "cubeattn_dense"), (True, "cubeattn_dense_det")):
            ms = median_ms(lambda: cubeattn.flash_attn_func(qg, kg, vg, causal=args.causal, deterministic=det).backward(g),
                           2, it, sync)
            rows.append(dict(fb, impl=name, keep=1.0, pattern="dense", ms=ms[0], ms_min=ms[1]))
        ms = median_ms(lambda: sdpa((qtg, ktg, vtg), gt), 2, it, sync)
        rows.append(dict(fb, impl="sdpa_flash", keep=1.0, pattern="dense", ms=ms[0], ms_min=ms[1]))
        for ratio in args.top_k_ratios:
            top_k = sp.top_k_for(nb, ratio)
            ix = sp.PATTERNS[args.pattern](B, H, nb, nb, top_k, seed=1)
            key = dict(base, keep=round(top_k / nb, 4), pattern=args.pattern)
            try:
                ms = median_ms(lambda: cubeattn.block_sparse_attn_func(q, k, v, ix, q_block=128, k_block=128,
                                                                       causal=args.causal), 3, it, sync)
                rows.append(dict(key, impl="cubeattn", ms=ms[0], ms_min=ms[1]))
                spec = cubeattn.sparse_spec((B * s, H, d), (B * s, H, d), "bfloat16", (np.arange(B + 1) * s).astype(np.int32),
                                            (np.arange(B + 1) * s).astype(np.int32), s, s, ix, 128, 128, causal=args.causal)
                ms = median_ms(lambda: cubeattn.block_sparse_attn_func(q, k, v, spec), 3, it, sync)
                rows.append(dict(key, impl="cubeattn_prepared", ms=ms[0], ms_min=ms[1]))
                for det, name in ((False, "cubeattn_prepared"), (True, "cubeattn_prepared_det")):
                    ms = median_ms(lambda: cubeattn.block_sparse_attn_func(qg, kg, vg, spec, deterministic=det).backward(g),
                                   2, it, sync)
                    rows.append(dict(key, what="sparse_fwdbwd", impl=name, ms=ms[0], ms_min=ms[1]))
                if args.quant_gran:
                    spec8 = cubeattn.sparse_spec((B * s, H, d), (B * s, H, d), "bfloat16",
                                                 (np.arange(B + 1) * s).astype(np.int32),
                                                 (np.arange(B + 1) * s).astype(np.int32), s, s, ix, 128, 128,
                                                 causal=args.causal, quant_gran=args.quant_gran)
                    ms = median_ms(lambda: cubeattn.block_sparse_attn_func(q, k, v, spec8), 3, it, sync)
                    a = cubeattn.block_sparse_attn_func(q, k, v, spec8)
                    b = cubeattn.block_sparse_attn_func(q, k, v, spec)
                    cos = _acc(a, b)["cosine"]
                    # both against the f64 block-sparse attention of the same inputs (batch 0, 4 heads)
                    heads = _ref_heads(H)
                    ref = _attention_f64(torch, q, k, v, heads, args.causal,
                                         block_keep=_block_keep(torch, ix[0, heads], nb, "cuda"))
                    rel_bf16 = _acc(b[0, :, heads], ref)["rel_l2"]
                    rows.append(dict(key, impl="cubeattn_int8", quant_gran=args.quant_gran, ms=ms[0], ms_min=ms[1],
                                     cosine=cos, rel_l2=_acc(a[0, :, heads], ref)["rel_l2"],
                                     rel_l2_bf16=rel_bf16, ref_heads=heads))
                    del a
                    pv = getattr(args, "pv_precision", None)
                    if pv:
                        try:  # the GPU may refuse FP8 P.V (no kernel yet): an error row, the rest goes on
                            spec8f = cubeattn.sparse_spec((B * s, H, d), (B * s, H, d), "bfloat16",
                                                          (np.arange(B + 1) * s).astype(np.int32),
                                                          (np.arange(B + 1) * s).astype(np.int32), s, s, ix, 128, 128,
                                                          causal=args.causal, quant_gran=args.quant_gran,
                                                          pv_precision=pv)
                            ms = median_ms(lambda: cubeattn.block_sparse_attn_func(q, k, v, spec8f), 3, it, sync)
                            a = cubeattn.block_sparse_attn_func(q, k, v, spec8f)
                            rows.append(dict(key, impl="cubeattn_int8_fp8", quant_gran=args.quant_gran,
                                             pv_precision=pv, ms=ms[0], ms_min=ms[1],
                                             cosine=_acc(a, b)["cosine"], rel_l2=_acc(a[0, :, heads], ref)["rel_l2"],
                                             rel_l2_bf16=rel_bf16, ref_heads=heads))
                            del a
                        except Exception as e:
                            rows.append(dict(key, impl="cubeattn_int8_fp8", quant_gran=args.quant_gran,
                                             pv_precision=pv, error=str(e)[:200]))
                    del b, ref
            except Exception as e:
                rows.append(dict(key, impl="cubeattn", error=str(e)[:200]))
            if flex is not None and not args.causal:
                try:
                    ti = torch.from_numpy(np.sort(np.where(ix < 0, np.iinfo(np.int32).max, ix), -1)).cuda()
                    num = (ti != np.iinfo(np.int32).max).sum(-1).to(torch.int32)
                    idx = torch.where(ti == np.iinfo(np.int32).max, 0, ti).to(torch.int32)
                    idx = torch.cat([idx, torch.zeros(B, H, nb, nb - idx.shape[-1], dtype=torch.int32, device="cuda")], -1)
                    bm = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=128)
                    ms = median_ms(lambda: flex(qt, kt, vt, block_mask=bm), 3, it, sync)
                    rows.append(dict(key, impl="flex", ms=ms[0], ms_min=ms[1]))
                    ms = median_ms(lambda: flex(qtg, ktg, vtg, block_mask=bm).backward(gt), 2, it, sync)
                    rows.append(dict(key, what="sparse_fwdbwd", impl="flex", ms=ms[0], ms_min=ms[1]))
                except Exception as e:
                    rows.append(dict(key, impl="flex", error=str(e)[:200]))
        del q, k, v, qt, kt, vt, qg, kg, vg, qtg, ktg, vtg, g, gt
    dense = {(r["what"], r["S"], r["impl"].endswith("_det")): r["ms"] for r in rows
             if r.get("impl") in ("cubeattn_dense", "cubeattn_dense_det") and "ms" in r}
    for r in rows:
        at = (r.get("what"), r.get("S"), r.get("impl", "").endswith("_det"))
        if r.get("impl") in ("cubeattn", "cubeattn_prepared", "cubeattn_prepared_det", "cubeattn_int8",
                             "cubeattn_int8_fp8") and "ms" in r \
                and at in dense:
            r["speedup"] = dense[at] / r["ms"]
            r["ideal"] = 1.0 / r["keep"]
    return rows


def _ref_heads(h, n=4):
    """The q heads the f64 accuracy reference covers: n of them, evenly spaced (several GQA groups)."""
    return sorted({i * h // n for i in range(n)})


def _attention_f64(torch, q, k, v, heads, causal, block_keep=None, block=128, rows=2048):
    """f64 attention of batch 0 for the q heads `heads`, computed where the tensors are (on the GPU
    for CUDA tensors), one head and `rows` query rows at a time: [Sq, len(heads), d] float64.
    q [B, Sq, Hq, d], k/v [B, Sk, Hkv, d] (GQA: q head h reads kv head h // (Hq / Hkv)); causal
    bottom-right; `block_keep` (optional, bool [len(heads), q_blocks, k_blocks]): the key blocks of
    a block-sparse pattern (`block`-sized). Rows that see no key: zeros."""
    sq, hq, d = q.shape[1:]
    sk, hkv = k.shape[1], k.shape[2]
    dev = q.device
    out = torch.zeros(sq, len(heads), d, dtype=torch.float64, device=dev)
    kj = torch.arange(sk, device=dev)
    for i, h in enumerate(heads):
        kh, vh = k[0, :, h // (hq // hkv)].double(), v[0, :, h // (hq // hkv)].double()
        for r0 in range(0, sq, rows):
            r = torch.arange(r0, min(sq, r0 + rows), device=dev)
            s = (q[0, r0:r0 + len(r), h].double() @ kh.T) * (d ** -0.5)
            mask = (kj[None, :] <= r[:, None] + (sk - sq)) if causal else None
            if block_keep is not None:
                bk = block_keep[i][r // block][:, kj // block]
                mask = bk if mask is None else mask & bk
            if mask is not None:
                s = s.masked_fill(~mask, float("-inf"))
            m = s.amax(-1, keepdim=True)
            p = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
            den = p.sum(-1, keepdim=True)
            out[r0:r0 + len(r), i] = (p @ vh) / torch.where(den > 0, den, torch.ones_like(den))
            del s, p, mask
    return out


def _block_keep(torch, ix, k_blocks, device):
    """A block index [..., q_blocks, top_k] (-1 = unused slot) -> bool [..., q_blocks, k_blocks]."""
    ix = torch.as_tensor(np.asarray(ix)).long()
    keep = torch.zeros(*ix.shape[:-1], k_blocks + 1, dtype=torch.bool)
    keep.scatter_(-1, torch.where(ix < 0, k_blocks, ix), True)
    return keep[..., :k_blocks].to(device)


def _acc(got, ref):
    """cosine similarity and relative L2 error (||got - ref|| / ||ref||) of two tensors, in f64."""
    g, r = got.double().flatten(), ref.double().flatten()
    rn = float(r.norm())
    return dict(cosine=float(g @ r) / max(float(g.norm()) * rn, 1e-300), rel_l2=float((g - r).norm()) / max(rn, 1e-300))


# K channel outliers of `bench sage --outliers`: these channels get +OUTLIER_SHIFT on every key (a
# per-channel bias, what K smoothing removes), and q is scaled by OUTLIER_Q_SCALE (larger logits:
# a peakier softmax that magnifies the Q K^T quantisation error).
OUTLIER_CHANNELS = (3, 17, 64, 101)
OUTLIER_SHIFT = 20.0
OUTLIER_Q_SCALE = 2.0


def _sage_rows(args, torch, dev="cuda"):
    """`bench sage` (issue 43): dense attention with INT8 Q K^T (`cubeattn.sageattn`) beside our
    exact forward (`flash_attn_func`) and SDPA's cuDNN and flash backends, `--dtype` (bf16), B=4,
    H=32 (kv heads `--num-kv-heads`, default H), d=128 unless given. Wall clock of the torch call, median,
    one sync per call. Rows: {what: "sage_fwd", impl: "cubeattn_int8" | "cubeattn_int8_fp8" (sageattn
    with pv_precision="fp8"; an error row where the GPU refuses it) | "cubeattn_bf16" |
    "sdpa_cudnn" | "sdpa_flash", inputs: "randn", B, H, H_kv, S, D, causal, ms, tflops (4 B H S^2 d,
    halved when causal, per time), cosine, rel_l2}: the accuracy against the f64 attention of the
    same (bf16) inputs, unquantised, on batch 0 and 4 q heads (`ref_heads`). With --outliers, also
    inputs "outliers" (K channel outliers, q scaled: OUTLIER_*), accuracy only, with
    "cubeattn_int8_nosmooth" (smooth_k=False) beside. `dev` is "cuda" here (tests run this code on
    CPU tensors: the SDPA backends then report an error row)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H, d = args.batch_size or 4, args.num_heads or 32, args.head_dim or 128
    hkv = args.num_kv_heads or H
    gran = args.quant_gran or "per_warp"
    causal, it = args.causal, args.iterations
    dt = getattr(args, "dtype", "bfloat16")
    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16}[dt]
    sync = torch.cuda.synchronize if dev == "cuda" else _no_sync
    heads = _ref_heads(H)
    rows = []
    for s in args.seqlens:
        flops = 4 * B * H * s * s * d / (2 if causal else 1)
        base = dict(what="sage_fwd", B=B, H=H, H_kv=hkv, S=s, D=d, causal=causal, dtype=dt, ref_heads=heads)
        dists = ["randn"] + (["outliers"] if args.outliers else [])
        for dist in dists:
            g = torch.Generator(device=dev).manual_seed(s)
            q, k, v = (torch.randn(B, s, h, d, device=dev, dtype=tdt, generator=g) for h in (H, hkv, hkv))
            if dist == "outliers":
                q = q * OUTLIER_Q_SCALE
                k[..., [c % d for c in OUTLIER_CHANNELS]] += OUTLIER_SHIFT
            key = dict(base, inputs=dist)
            ref = _attention_f64(torch, q, k, v, heads, causal)
            qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # [B, H, S, d] for SDPA
            timed = dist == "randn"

            def sdpa(be):
                def run():
                    with sdpa_kernel(be):
                        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=hkv != H)
                return lambda: run().transpose(1, 2)

            # device=dev: a call the CUDA backend refuses raises (an error row) instead of running on the CPU
            impls = [("cubeattn_int8", lambda: cubeattn.sageattn(q, k, v, is_causal=causal, quant_gran=gran,
                                                                 device=dev), dict(quant_gran=gran)),
                     ("cubeattn_int8_fp8", lambda: cubeattn.sageattn(q, k, v, is_causal=causal, quant_gran=gran,
                                                                     pv_precision="fp8", device=dev),
                      dict(quant_gran=gran, pv_precision="fp8")),
                     ("cubeattn_bf16", lambda: cubeattn.flash_attn_func(q, k, v, causal=causal, device=dev), {})]
            if timed:
                impls += [("sdpa_cudnn", sdpa(SDPBackend.CUDNN_ATTENTION), {}),
                          ("sdpa_flash", sdpa(SDPBackend.FLASH_ATTENTION), {})]
            else:
                impls.insert(1, ("cubeattn_int8_nosmooth", lambda: cubeattn.sageattn(q, k, v, is_causal=causal,
                                                                                     quant_gran=gran, smooth_k=False,
                                                                                     device=dev),
                                 dict(quant_gran=gran, smooth_k=False)))
            for name, fn, extra in impls:
                try:
                    r = dict(key, impl=name, **extra)
                    if timed:
                        ms = median_ms(fn, 3, it, sync)
                        r.update(ms=ms[0], ms_min=ms[1], ms_max=ms[2], tflops=flops / ms[0] / 1e9)
                    r.update(_acc(fn()[0, :, heads], ref))
                    rows.append(r)
                except Exception as e:  # report, keep the others
                    rows.append(dict(key, impl=name, error=str(e)[:200]))
            del q, k, v, qt, kt, vt, ref
    return rows


def _sparse_ref(q, k, v, ix, q_block, k_block, causal):
    """f64 block-sparse attention of one batched call: dense softmax under the token mask expanded
    from the block mask (rows with no visible key: zeros). q [B, S, H, d], ix [B, H, qb, top_k]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, S, H, d = q.shape
    Sk = k.shape[1]
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(H):
            keep = np.zeros((-(-S // q_block), -(-Sk // k_block)), bool)
            for qb in range(keep.shape[0]):
                sel = ix[b, h, qb]
                keep[qb, sel[sel >= 0]] = True
            mask = np.repeat(np.repeat(keep, q_block, 0), k_block, 1)[:S, :Sk]
            if causal:
                mask &= np.arange(Sk)[None, :] <= Sk - S + np.arange(S)[:, None]
            sc = np.where(mask, q[b, :, h] @ k[b, :, h].T / np.sqrt(d), -np.inf)
            m = sc.max(-1, keepdims=True)
            p = np.where(mask, np.exp(sc - np.where(np.isfinite(m), m, 0)), 0.0)
            l = p.sum(-1, keepdims=True)
            out[b, :, h] = (p / np.where(l > 0, l, 1)) @ v[b, :, h]
    return out


def _sparse_check(args, device, patterns):
    """Seed 004's --test_correctness / --test_patterns: every pattern x kept fraction, causal as
    asked, small shapes (B <= 2, H <= 4, S <= 1024, d as asked), against the f64 reference. With
    --stress (seed 004's larger configurations): B <= 4, H <= 8, S <= 4096."""
    from . import sparse_patterns as sp

    if args.stress:
        B, H, S = min(args.batch_size or 4, 4), min(args.num_heads or 8, 8), min(max(args.seqlens), 4096)
    else:
        B, H, S = min(args.batch_size or 2, 2), min(args.num_heads or 4, 4), min(max(args.seqlens), 1024)
    d = args.head_dim or 128
    dt = "float32" if device == "cpu" else "float16"
    rng = np.random.default_rng(0)
    rows = []
    for pat in patterns:
        for ratio in args.top_k_ratios:
            nq, nk = -(-S // 64), -(-S // 128)
            ix = sp.PATTERNS[pat](B, H, nq, nk, sp.top_k_for(nk, ratio), seed=1)
            q, k, v = (rng.standard_normal((B, S, H, d)).astype(np.float32) for _ in range(3))
            if dt == "float16":
                q, k, v = (x.astype(np.float16) for x in (q, k, v))
            try:
                out = cubeattn.block_sparse_attn_func(q, k, v, ix, causal=args.causal, device=device)
                want = _sparse_ref(q, k, v, ix, 64, 128, args.causal)
                err = float(np.linalg.norm(out.astype(np.float64) - want) / max(np.linalg.norm(want), 1e-30))
                ok = bool(np.all(np.isfinite(out.astype(np.float32)))) and err < (1e-5 if dt == "float32" else 2e-3)
                rows.append(dict(what="sparse_check", impl=f"cubeattn_{cubeattn.last_backend()}", S=S, pattern=pat,
                                 keep=round(ix.shape[-1] / nk, 4), causal=args.causal, rel_err=err, ok=ok))
            except Exception as e:
                rows.append(dict(what="sparse_check", impl="cubeattn", S=S, pattern=pat, error=str(e)[:200], ok=False))
    return rows


def _sparse(args, device, torch):
    """`bench sparse`: the correctness checks asked for, then the timings (unless only checks were
    asked for)."""
    rows = []
    if args.test_correctness or args.test_patterns:
        pats = ["random", "local", "strided", "block_diagonal"] if args.test_patterns else [args.pattern]
        rows += _sparse_check(args, device, pats)
    if args.benchmark_perf or not (args.test_correctness or args.test_patterns):
        rows += bench_sparse_cpu(args) if device == "cpu" else _cuda_sparse(args, torch)
    return rows


# ---------------------------------------------------------------- output

def _hf_train(args, torch):
    from .bench_hf import hf_train

    return hf_train(args, torch)


def print_table(rows):
    cols = [c for c in ("what", "config", "causal", "impl", "cache", "part", "B", "S", "T", "W", "window", "rank", "P", "G",
                        "pattern", "inputs", "quant_gran", "pv_precision",
                        "kept", "keep", "ms", "gflops", "tflops", "speedup", "ideal", "fwd_ms", "fwd_tflops_per_gpu", "fwdbwd_ms",
                        "tflops_per_gpu", "exposed_comm_fwd_ms", "exposed_comm_fwdbwd_ms", "cosine", "rel_l2", "rel_l2_bf16", "rel_err",
                        "rel_err_vs_cubeattn", "ok", "error")
            if any(c in r for r in rows)]
    fmt = lambda v: (f"{v:.3f}" if v == 0 or abs(v) >= 0.01 else f"{v:.2e}") if isinstance(v, float) else str(v)
    # a cosine similarity near 1 needs its digits
    table = [[f"{r[c]:.6f}" if c == "cosine" and isinstance(r.get(c), float) else fmt(r.get(c, "")) for c in cols]
             for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for t in table:
        print("  ".join(x.ljust(w) for x, w in zip(t, widths)))


def maybe_png(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    dense = [r for r in rows if r.get("what") == "dense_fwd" and "ms" in r]
    if not dense:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for impl in sorted({r["impl"] for r in dense}):
        pts = [(r["S"], r["ms"]) for r in dense if r["impl"] == impl]
        ax.plot(*zip(*pts), marker="o", label=impl)
    ax.set_xscale("log", base=2); ax.set_yscale("log"); ax.set_xlabel("sequence length"); ax.set_ylabel("ms")
    ax.legend(); fig.tight_layout(); fig.savefig(path)
    return True


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["figure"]:
        from .perf_figure import main as figure

        return figure(argv[1:])
    p = argparse.ArgumentParser(prog="python -m cubeattn.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="?", default="dense",
                   choices=["dense", "grouped", "fwdbwd", "autograd", "callpath", "zigzag", "sparse", "sage", "hf_train"])
    p.add_argument("--quick", action="store_true", help="small shapes, few iterations")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--config", default=None, choices=sorted(CONFIGS))
    p.add_argument("--configs", nargs="+", default=["llama3-8b", "llama3-70b"], choices=sorted(CONFIGS))
    p.add_argument("--seqlens", "--seq_lens", "--seq-lens", nargs="+", type=int, default=None)
    p.add_argument("--batch_size", "--batch-size", type=int, default=None,
                   help="sparse / sage: batch (default 4 on CUDA); dense / fwdbwd: sequences of S tokens (default 1)")
    p.add_argument("--num_heads", "--num-heads", type=int, default=None, help="sparse, sage: heads (default 32 on CUDA)")
    p.add_argument("--num_kv_heads", "--num-kv-heads", type=int, default=None,
                   help="sage: kv heads (default: --num_heads; must divide it)")
    p.add_argument("--head_dim", "--head-dim", type=int, default=None, help="sparse: head_dim (default 128 on CUDA)")
    p.add_argument("--test_correctness", "--test-correctness", action="store_true",
                   help="sparse: check against the f64 masked-dense reference (small shapes)")
    p.add_argument("--test_patterns", "--test-patterns", action="store_true",
                   help="sparse: the correctness check over all four patterns")
    p.add_argument("--benchmark_perf", "--benchmark-perf", action="store_true",
                   help="sparse: time (the default when no test flag is given)")
    p.add_argument("--stress", action="store_true",
                   help="sparse: the correctness checks at larger configurations (B <= 4, H <= 8, S <= 4096)")
    p.add_argument("--iterations", type=int, default=None)
    p.add_argument("--causal", dest="causal", action="store_true", default=True)
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--naive-max", type=int, default=4096, help="longest S for the naive numpy peer")
    p.add_argument("--heads-k-stride", type=int, default=None,
                   help="zigzag: kv heads all-gathered per step (default: all of them)")
    p.add_argument("--keep-gathered-kv", action="store_true",
                   help="zigzag: the backward reuses the forward's gathered K,V (keep_gathered_kv=True)")
    p.add_argument("--window", type=int, default=None,
                   help="zigzag: also time cubeattn with the causal sliding window (WINDOW, 0) (row impl "
                        "cubeattn_window; no peer has one)")
    p.add_argument("--pattern", default="random", choices=["random", "local", "strided", "block_diagonal"],
                   help="sparse: block pattern")
    p.add_argument("--top_k_ratios", "--top-k-ratios", nargs="+", type=float, default=[0.25, 0.5, 0.75, 1.0],
                   help="sparse: kept fractions of the key blocks")
    p.add_argument("--qk-int8", "--qk_int8", action="store_true", help="sparse: --quant_gran per_warp")
    p.add_argument("--quant_gran", "--quant-gran", default=None, choices=["per_block", "per_warp", "per_thread"],
                   help="sparse: also time the INT8 QK^T option with this scale granularity; sage: the granularity "
                        "(default per_warp)")
    p.add_argument("--pv-precision", "--pv_precision", dest="pv_precision", default=None, choices=["fp8"],
                   help="sparse: also time the INT8 option with FP8 P.V (implies --quant_gran per_warp unless "
                        "given); sage always has its FP8 P.V rows")
    p.add_argument("--outliers", action="store_true",
                   help="sage: also measure the accuracy on inputs with outlier channels in K (and q scaled)")
    p.add_argument("--dense-only", action="store_true", help="fwdbwd: the dense rows only (no grouped zigzag)")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--png", default=None, help="write a plot here (needs matplotlib)")
    args = p.parse_args(argv)
    args.seqlens_given = args.seqlens is not None
    if (args.qk_int8 or args.pv_precision) and args.quant_gran is None:
        args.quant_gran = "per_warp"
    st = cubeattn.backend_status()
    device = args.device if args.device != "auto" else ("cuda" if st["cuda_available"] else "cpu")
    if args.what == "sage":
        if args.num_kv_heads is not None and (args.num_kv_heads < 1 or (args.num_heads or 32) % args.num_kv_heads):
            p.error(f"--num-kv-heads {args.num_kv_heads} must divide --num-heads {args.num_heads or 32}")
        torch = _torch()
        why = (st["reason"] or "CUDA backend not available") if not st["cuda_available"] else \
            "--device cpu" if device == "cpu" else "torch is not installed" if torch is None else \
            "torch has no CUDA" if not torch.cuda.is_available() else None
        if why:
            print(f"# cubeattn bench sage: skipped, it needs CUDA (cubeattn's INT8 kernels beside cuDNN and "
                  f"FlashAttention): {why}")
            return 0
    if device == "cuda" and not st["cuda_available"]:
        p.error(f"--device cuda: {st['reason']}")
    if args.what == "zigzag":
        # under torchrun: every rank runs this; rank 0 prints and writes the JSON
        torch = _torch()
        if torch is None:
            p.error("the zigzag benchmark needs torch (torch.distributed)")
        if device == "cuda" and not torch.cuda.is_available():
            p.error("the zigzag benchmark on CUDA needs torch with CUDA")
        args.config = args.config or ("llama3-8b" if device == "cuda" else "cpu-small")
        args.seqlens = args.seqlens or ([16384] if device == "cuda" else [512])
        args.iterations = args.iterations or (5 if args.quick else 20)
        rows = _cp_zigzag(args, torch, device)
        import torch.distributed as dist

        if dist.get_rank() != 0:
            dist.destroy_process_group()
            return 0
        dist.destroy_process_group()
    elif device == "cpu":
        args.config = args.config or "cpu-small"
        args.seqlens = args.seqlens or ([1024, 2048] if args.quick else [2048, 4096])
        args.iterations = args.iterations or (3 if args.quick else 5)
        if args.what not in ("dense", "fwdbwd", "sparse"):
            p.error(f"the {args.what} benchmark compares GPU kernels: run it with a CUDA build on a GPU")
        rows = _sparse(args, device, None) if args.what == "sparse" else bench_cpu(args)
    else:
        torch = _torch()
        if torch is None or not torch.cuda.is_available():
            p.error("the CUDA benchmark needs torch with CUDA for the peers")
        if args.what != "fwdbwd":  # fwdbwd: every dense config unless --config names one
            args.config = args.config or "llama3-8b"
        args.seqlens = args.seqlens or ([8192] if args.what == "sparse" else [4096] if args.what == "hf_train"
                                        else ([8192] if args.quick else [8192, 16384]) if args.what == "sage"
                                        else [4096, 8192] if args.quick else [4096, 8192, 16384, 32768])
        if args.what != "hf_train":  # hf_train: --iterations = training steps (default 25)
            args.iterations = args.iterations or (5 if args.quick else 20)
        rows = {"dense": _cuda_dense, "grouped": _cuda_grouped, "fwdbwd": _cuda_fwdbwd,
                "autograd": _cuda_autograd, "callpath": _cuda_callpath,
                "sparse": lambda a, t: _sparse(a, device, t), "sage": _sage_rows,
                "hf_train": _hf_train}[args.what](args, torch)
    env = environment(device)
    print(f"# cubeattn bench {args.what} on {device}: {env.get('gpu_name', platform.processor() or 'cpu')}, "
          f"{env['date']}, commit {env['commit']}")
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            # output paths by file name only: a record names no directory of the machine it ran on
            recorded = {k: (os.path.basename(v) if k in ("json", "png") and v else v) for k, v in vars(args).items()}
            json.dump({"env": env, "args": recorded, "rows": rows}, f, indent=1)
    if args.png:
        maybe_png(rows, args.png)
    failed = [r for r in rows if r.get("ok") is False]
    if failed:
        print(f"# {len(failed)} check(s) failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
