#!/usr/bin/env python3
"""A/B of the 128-key dK/dV kernel (CUBEATTN_BWD_WIDE=1) against the 64-key one, in ONE process.

    python3 bench/ab_bwd_wide.py [--quick] [--iters N] [--rounds R]

Needs torch (CUDA) and the cubeattn wheel of this branch. The switch is read by the backward on
every call (src/backend/cuda/backward.rs `bwd_wide`), so this script flips os.environ between calls.
dQ paths: `deterministic=True` takes the separate dQ pass; `deterministic=False` with
CUBEATTN_BWD_DQ=atomic (set once, below, before any call: the workspace size depends on it and
is cached per (spec, deterministic)) takes dQ fused into the dK/dV kernel with f32 atomics.

1. Correctness (small shapes, bf16/f16, GQA 8/2): gradients of old/new kernel x pass/atomic
   against an f32 reference with the exact mask (per segment; varlen with odd lengths, Sq != Sk,
   causal, non-causal, sliding windows, d64/d128) and new vs old; at 8K causal d128 (32/8 heads)
   against SDPA flash too. A new kernel whose gradients are bitwise those of the old one on the
   pass path means the switch did not take: reported as "SWITCH?".
2. Timing (bf16, 32/8 heads, B=1): fwd+bwd through torch autograd and the backward alone
   (torch.autograd.grad on a kept graph), 8K causal, 16K causal, 8K non-causal d128, 8K causal d64;
   variants old/new x pass/atomic and SDPA flash, interleaved round by round; each entry is the
   median over rounds of an event-timed loop of `iters` steps.
"""
import argparse
import itertools
import os
import statistics
import sys
import time

os.environ["CUBEATTN_BWD_DQ"] = "atomic"  # before cubeattn reads it (see the docstring)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import cubeattn  # noqa: E402

DEV = "cuda"
VARIANTS = [("old", "pass"), ("new", "pass"), ("old", "atomic"), ("new", "atomic")]


def set_wide(which):
    os.environ["CUBEATTN_BWD_WIDE"] = "1" if which == "new" else "0"


def ours(q, k, v, cu_q, cu_k, mq, mk, causal, window, path, which):
    set_wide(which)
    return cubeattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=causal, window_size=window,
                                           deterministic=(path == "pass"))


def grads_of(fn, q, k, v, g):
    q.grad = k.grad = v.grad = None
    out = fn()
    out.backward(g)
    torch.cuda.synchronize()
    return [x.grad.detach().clone() for x in (q, k, v)]


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def reference(q, k, v, g, lens_q, lens_k, causal, window, scale):
    """f32 gradients with the exact mask, segment by segment (flash-attn's bottom-right causal and
    sliding window; every row of the cases below sees at least one key)."""
    qf, kf, vf = (x.detach().float().requires_grad_(True) for x in (q, k, v))
    hq, hkv = q.shape[1], k.shape[1]
    outs = []
    oq = ok = 0
    for sq, sk in zip(lens_q, lens_k):
        qs, ks, vs = qf[oq:oq + sq], kf[ok:ok + sk], vf[ok:ok + sk]
        ks = ks.repeat_interleave(hq // hkv, dim=1)
        vs = vs.repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        i = torch.arange(sq, device=DEV)[:, None]
        j = torch.arange(sk, device=DEV)[None, :]
        diag = i + (sk - sq)
        left, right = window
        vis = torch.ones(sq, sk, dtype=torch.bool, device=DEV)
        if causal:
            right = 0
        if right >= 0:
            vis &= j <= diag + right
        if left >= 0:
            vis &= j >= diag - left
        s = s.masked_fill(~vis, float("-inf"))
        p = torch.softmax(s, dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", p, vs))
        oq += sq
        ok += sk
    torch.cat(outs).backward(g.float())
    return [x.grad for x in (qf, kf, vf)]


def check_small(dtype, d, causal, window, lens_q, lens_k, name, seed):
    torch.manual_seed(seed)
    hq, hkv = 8, 2
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, hq, d, device=DEV, dtype=dtype, requires_grad=True)
    k = torch.randn(tk, hkv, d, device=DEV, dtype=dtype, requires_grad=True)
    v = torch.randn(tk, hkv, d, device=DEV, dtype=dtype, requires_grad=True)
    g = torch.randn(tq, hq, d, device=DEV, dtype=dtype)
    cu_q = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32)
    ref = reference(q, k, v, g, lens_q, lens_k, causal, window, d ** -0.5)
    res = {}
    for which, path in VARIANTS:
        res[(which, path)] = grads_of(
            lambda: ours(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal, window, path, which), q, k, v, g)
    worst = 0.0
    line = f"{name:<44}"
    for path in ("pass", "atomic"):
        new, old = res[("new", path)], res[("old", path)]
        e_new = [rel(a, b) for a, b in zip(new, ref)]
        e_old = [rel(a, b) for a, b in zip(old, ref)]
        e_no = max(rel(a, b) for a, b in zip(new, old))
        worst = max(worst, max(e_new) / max(max(e_old), 1e-6))
        same = path == "pass" and all(torch.equal(a, b) for a, b in zip(new, old))
        line += (f" | {path[:4]} new {e_new[0]:.1e} {e_new[1]:.1e} {e_new[2]:.1e}"
                 f" old {max(e_old):.1e} n/o {e_no:.1e}{' SWITCH?' if same else ''}")
    tol = 1.2e-2 if dtype == torch.bfloat16 else 6e-3
    ok = all(max(rel(a, b) for a, b in zip(res[("new", p)], ref)) <= tol for p in ("pass", "atomic"))
    print(line + ("  ok" if ok else "  FAIL"), flush=True)
    return ok


def make_big(s, hq, hkv, d, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(s, hq, d, device=DEV, dtype=dtype, requires_grad=True)
    k = torch.randn(s, hkv, d, device=DEV, dtype=dtype, requires_grad=True)
    v = torch.randn(s, hkv, d, device=DEV, dtype=dtype, requires_grad=True)
    g = torch.randn(s, hq, d, device=DEV, dtype=dtype)
    q4, k4, v4 = (x.detach().transpose(0, 1).unsqueeze(0).requires_grad_(True) for x in (q, k, v))
    g4 = g.transpose(0, 1).unsqueeze(0)
    return q, k, v, g, q4, k4, v4, g4


def sdpa_fn(q4, k4, v4, causal):
    def f():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal, enable_gqa=True)
    return f


def check_big(s, causal):
    q, k, v, g, q4, k4, v4, g4 = make_big(s, 32, 8, 128)
    cu = torch.tensor([0, s], dtype=torch.int32)
    ref = [x.squeeze(0).transpose(0, 1) for x in grads_of(sdpa_fn(q4, k4, v4, causal), q4, k4, v4, g4)]
    line = f"{s // 1024}K {'causal' if causal else 'full'} d128 32/8 vs SDPA flash".ljust(44)
    ok = True
    for which, path in VARIANTS:
        gr = grads_of(lambda: ours(q, k, v, cu, cu, s, s, causal, (-1, -1), path, which), q, k, v, g)
        e = [rel(a, b) for a, b in zip(gr, ref)]
        ok &= max(e) < 1e-2
        line += f" | {which} {path[:4]} {e[0]:.1e} {e[1]:.1e} {e[2]:.1e}"
    print(line + ("  ok" if ok else "  FAIL"), flush=True)
    return ok


def event_ms(fn, iters):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / iters


def bench_shape(s, d, causal, iters, rounds, wide_only_atomic=False):
    q, k, v, g, q4, k4, v4, g4 = make_big(s, 32, 8, d)
    cu = torch.tensor([0, s], dtype=torch.int32)
    fns = {}
    for which, path in VARIANTS:
        def step(which=which, path=path):
            q.grad = k.grad = v.grad = None
            ours(q, k, v, cu, cu, s, s, causal, (-1, -1), path, which).backward(g)

        # backward alone: one forward kept, torch.autograd.grad with retain_graph
        set_wide(which)
        out = ours(q, k, v, cu, cu, s, s, causal, (-1, -1), path, which)

        def bwd(which=which, out=out):
            set_wide(which)
            torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
        fns[(which, path)] = (step, bwd)
    sd = sdpa_fn(q4, k4, v4, causal)

    def sd_step():
        q4.grad = k4.grad = v4.grad = None
        sd().backward(g4)
    out4 = sd()

    def sd_bwd():
        torch.autograd.grad(out4, (q4, k4, v4), g4, retain_graph=True)
    fns[("sdpa", "flash")] = (sd_step, sd_bwd)
    # warm-up (NVRTC compiles of the first call, the plan upload, torch's allocator)
    for f, b in fns.values():
        f()
        b()
    torch.cuda.synchronize()
    times = {key: ([], []) for key in fns}
    for _ in range(rounds):
        for key, (f, b) in fns.items():
            times[key][0].append(event_ms(f, iters))
            times[key][1].append(event_ms(b, iters))
    del out, out4
    return {key: (statistics.median(a), statistics.median(b)) for key, (a, b) in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="8K causal d128 only, 3 rounds")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--skip-check", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, cubeattn {getattr(cubeattn, '__version__', '?')}")
    ok = True
    if not args.skip_check:
        print("== gradients: rel L2 error (dq dk dv) vs f32 reference; old = max of the 64-key kernel's; "
              "n/o = new vs old ==")
        bf, h = torch.bfloat16, torch.float16
        odd = [1, 63, 130, 777, 1001]
        cases = [
            (bf, 128, True, (-1, -1), odd, odd, "bf16 d128 causal varlen odd"),
            (bf, 128, False, (-1, -1), odd, odd, "bf16 d128 full varlen odd"),
            (bf, 64, True, (-1, -1), odd, odd, "bf16 d64 causal varlen odd"),
            (bf, 64, False, (-1, -1), odd, odd, "bf16 d64 full varlen odd"),
            (h, 128, True, (-1, -1), [300, 1500], [300, 1500], "f16 d128 causal varlen"),
            (h, 64, False, (-1, -1), [129, 700], [129, 700], "f16 d64 full varlen"),
            (bf, 128, True, (-1, -1), [300, 77], [1000, 333], "bf16 d128 causal sq<sk varlen"),
            (bf, 64, False, (-1, -1), [450], [200], "bf16 d64 full sq>sk"),
            (bf, 128, True, (256, 0), [1500], [1500], "bf16 d128 window (256,0) causal"),
            (bf, 128, False, (100, 37), odd, odd, "bf16 d128 window (100,37) varlen odd"),
            (bf, 64, False, (5, 130), [700], [650], "bf16 d64 window (5,130) sq>sk"),
        ]
        for i, c in enumerate(cases):
            ok &= check_small(*c, seed=100 + i)
        ok &= check_big(8192, True)
        print(f"-- checks {'passed' if ok else 'FAILED'} ({time.time() - t0:.0f} s)", flush=True)
    shapes = [(8192, 128, True)] if args.quick else [(8192, 128, True), (16384, 128, True), (8192, 128, False),
                                                      (8192, 64, True)]
    rounds = 3 if args.quick else args.rounds
    print(f"== timing: bf16 32/8 heads B=1, median of {rounds} rounds of {args.iters}-step event-timed loops, "
          "ms (fwd+bwd / bwd only) ==")
    hdr = f"{'shape':<18}" + "".join(f"{w + ' ' + p:>16}" for w, p in VARIANTS) + f"{'sdpa flash':>16}" + \
        f"{'new/old pass':>14}{'new/old atom':>14}{'new pass/FA2':>14}"
    print(hdr)
    for s, d, causal in shapes:
        r = bench_shape(s, d, causal, args.iters, rounds)
        name = f"{s // 1024}K {'causal' if causal else 'full'} d{d}"
        for part, label in ((0, "fwd+bwd"), (1, "bwd")):
            cells = "".join(f"{r[key][part]:>16.3f}" for key in VARIANTS + [("sdpa", "flash")])
            np_, op_ = r[("new", "pass")][part], r[("old", "pass")][part]
            na, oa = r[("new", "atomic")][part], r[("old", "atomic")][part]
            fa = r[("sdpa", "flash")][part]
            print(f"{name + ' ' + label:<18}{cells}{np_ / op_:>14.3f}{na / oa:>14.3f}{min(np_, na) / fa:>14.3f}",
                  flush=True)
        torch.cuda.empty_cache()
    print(f"-- total {time.time() - t0:.0f} s; checks {'passed' if ok else 'FAILED'}")
    os.environ.pop("CUBEATTN_BWD_WIDE", None)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
