"""Distributed checks of cubeattn's zigzag llama3 layer: every rank's output and dq/dk/dv against
attention over the whole packed batch in one process (torch SDPA in float64 on the CPU, float32 on
CUDA, and cubeattn's own varlen call in the input dtype).

* pytest (tests/python/test_zigzag.py) spawns W processes on CPU tensors with gloo (`spawn_main`).
* On GPUs, one process per GPU with NCCL:
    python -m torch.distributed.run --nproc_per_node 2 tests/python/zigzag_worker.py --dtype bfloat16
  exits non-zero (after printing every failed check) when a check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

# forward / backward bounds on ||got - ref|| / ||ref||: vs the float32/float64 reference (seed 000's
# 1e-3 / 1e-2 plus the rounding of the output dtype), and vs one-process cubeattn in the same dtype
TOL = {
    "float32": {"ref": (1e-5, 1e-4), "one": (1e-5, 1e-4)},
    "float16": {"ref": (2e-3, 5e-3), "one": (1e-3, 1e-2)},
    "bfloat16": {"ref": (8e-3, 2e-2), "one": (4e-3, 1e-2)},
}


def cpu_cases(world_size):
    """Small varlen batches for the gloo test: lengths that are multiples of 2W (an empty sequence
    among them), GQA 4/2 and 4/1, head_dim 64 and odd ones, one and two kv-head slices, causal and
    not; chunks of 64 keys (the in-place read of the gathered K,V) or not (the ordered copy);
    `keep`: the backward reuses the forward's gathered K,V (keep_gathered_kv). Then any lengths
    (1-token sequences, 7, 13, 1000, fewer tokens than ranks, ranks without a token, no token at
    all) and sliding
    windows (causal; without causal both sides, one side, (0, 2)), given the full cu_seqlens
    (`full`)."""
    m = 2 * world_size
    return [
        dict(seqlens=[5 * m, 12 * m, 3 * m], hq=4, hkv=2, d=64, stride=1, causal=True),
        dict(seqlens=[7 * m, 0, 2 * m], hq=4, hkv=2, d=40, stride=2, causal=True, keep=True),
        dict(seqlens=[9 * m], hq=2, hkv=2, d=24, stride=1, causal=False, full=True),
        # chunks of 64 keys: the in-place read of the gathered K,V (kv_block_table)
        dict(seqlens=[64 * m, 0, 128 * m], hq=4, hkv=2, d=32, stride=1, causal=True, keep=True),
        dict(seqlens=[64 * m], hq=2, hkv=2, d=16, stride=2, causal=False),
        # any lengths
        dict(seqlens=[1, 7, 13, 1000, 2], hq=4, hkv=2, d=32, stride=1, causal=True, full=True),
        dict(seqlens=[13, 1, 0, 6, 1], hq=4, hkv=1, d=24, stride=1, causal=False, full=True, keep=True),
        dict(seqlens=[1, 1, 1], hq=2, hkv=1, d=16, stride=1, causal=True, full=True),
        dict(seqlens=[0, 0], hq=2, hkv=1, d=16, stride=1, causal=True, full=True),
        # sliding windows (the last: chunks of 64 keys, read through the ordered copy)
        dict(seqlens=[100, 7, 333], hq=4, hkv=2, d=32, stride=2, causal=True, window=(37, 0), full=True),
        dict(seqlens=[77, 1, 250], hq=4, hkv=2, d=16, stride=1, causal=False, window=(20, 9), full=True, keep=True),
        dict(seqlens=[61, 200], hq=2, hkv=1, d=16, stride=1, causal=False, window=(-1, 5), full=True),
        dict(seqlens=[200, 3, 61], hq=2, hkv=1, d=16, stride=1, causal=False, window=(11, -1), full=True),
        dict(seqlens=[31, 9], hq=2, hkv=2, d=8, stride=1, causal=False, window=(0, 2), full=True),
        dict(seqlens=[64 * m, 64 * m], hq=4, hkv=2, d=32, stride=1, causal=True, window=(100, -1), keep=True),
    ]


def gpu_cases(world_size):
    """Seed 000's shapes: Llama3-8B heads at 4K, 8K and 16K tokens, varlen uneven, GQA 32/8 and 64/8;
    then any lengths (packed documents of arbitrary lengths, 1-token ones, fewer tokens than ranks, none)
    and sliding windows (causal 4096 (Mistral's) on 8K tokens; non-causal both sides, one side)."""
    m = 2 * world_size * 64
    return [
        dict(seqlens=[4096 // m * m], hq=32, hkv=8, d=128, stride=8, causal=True),
        dict(seqlens=[8192 // m * m], hq=32, hkv=8, d=128, stride=4, causal=True),
        dict(seqlens=[16384 // m * m], hq=32, hkv=8, d=128, stride=8, causal=True, keep=True),
        dict(seqlens=[3 * m, 17 * m, 5 * m], hq=64, hkv=8, d=128, stride=2, causal=True, keep=True),
        dict(seqlens=[7 * m, 2 * m], hq=8, hkv=2, d=64, stride=1, causal=True),
        # any lengths
        dict(seqlens=[1, 7, 13, 1000, 4093, 1, 2500], hq=32, hkv=8, d=128, stride=8, causal=True, full=True),
        dict(seqlens=[8191, 3, 77], hq=32, hkv=8, d=128, stride=4, causal=True, full=True, keep=True),
        dict(seqlens=[1, 2, 3], hq=8, hkv=2, d=64, stride=1, causal=True, full=True),
        dict(seqlens=[0, 0], hq=8, hkv=2, d=64, stride=2, causal=True, full=True),
        dict(seqlens=[999, 1, 1500], hq=8, hkv=2, d=64, stride=2, causal=False, full=True),
        # sliding windows
        dict(seqlens=[8192 // m * m], hq=32, hkv=8, d=128, stride=8, causal=True, window=(4095, 0)),
        dict(seqlens=[5000, 3, 1234], hq=32, hkv=8, d=128, stride=4, causal=True, window=(511, -1), full=True,
             keep=True),
        dict(seqlens=[3001, 700], hq=8, hkv=2, d=64, stride=1, causal=False, window=(256, 128), full=True),
        dict(seqlens=[2048, 5], hq=8, hkv=2, d=64, stride=2, causal=False, window=(-1, 64), full=True),
    ]


def _rel(a, b, whole):
    """||a - b|| / ||b||, with ||b|| floored at what this rank's rows would weigh at the RMS row of
    `whole` (the tensor over the whole batch): a rank whose rows have a gradient near zero (rows
    that see one key have dq = 0 exactly, up to rounding) is not held to a relative bound on noise."""
    a, b = a.double(), b.double()
    rows = max(b.shape[0], 1) if b.dim() else 1
    floor = whole.double().norm().item() * (rows / max(whole.shape[0], 1)) ** 0.5
    n = max(b.norm().item(), floor)
    return (a - b).norm().item() / (n if n > 0 else 1.0)


def _reference(q, k, v, cu, causal, window, dtype):
    """out over the whole batch, one SDPA call per sequence (GQA by repeating K,V heads); a
    sliding window (flash-attn's (left, right), -1 = unbounded) as a boolean mask."""
    import torch
    import torch.nn.functional as F

    outs = []
    g = q.shape[1] // k.shape[1]
    left, right = window
    for b in range(len(cu) - 1):
        s, e = int(cu[b]), int(cu[b + 1])
        if e == s:
            continue
        qq = q[s:e].to(dtype).transpose(0, 1).unsqueeze(0)
        kk = k[s:e].to(dtype).repeat_interleave(g, 1).transpose(0, 1).unsqueeze(0)
        vv = v[s:e].to(dtype).repeat_interleave(g, 1).transpose(0, 1).unsqueeze(0)
        if window == (-1, -1):
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
        else:
            i = torch.arange(e - s, device=q.device)
            rel = i[None, :] - i[:, None]  # key position - query position
            ok = torch.ones_like(rel, dtype=torch.bool)
            if left >= 0:
                ok &= rel >= -left
            if right >= 0 or causal:
                ok &= rel <= (0 if causal else right)
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=ok)
        outs.append(o[0].transpose(0, 1))
    if not outs:  # no token: still a function of q, k, v (zero gradients)
        return q.new_zeros((0,) + tuple(q.shape[1:]), dtype=dtype) * (q.sum() + k.sum() + v.sum())
    return torch.cat(outs, 0)


def run_case(case, dtype_name, device, group=None, seed=0):
    """Runs one case on this rank; returns {check: relative error} (also max/mean abs errors)."""
    import numpy as np
    import torch
    import torch.distributed as dist

    import cubeattn

    w, r = dist.get_world_size(group), dist.get_rank(group)
    dt = getattr(torch, dtype_name)
    cu = np.concatenate([[0], np.cumsum(case["seqlens"])]).astype(np.int32)
    total, hq, hkv, d = int(cu[-1]), case["hq"], case["hkv"], case["d"]
    gen = torch.Generator().manual_seed(seed)  # same full batch on every rank
    q, k, v, dout = (torch.randn(total, h, d, generator=gen) for h in (hq, hkv, hkv, hq))
    q, k, v, dout = (x.to(dt).to(device) for x in (q, k, v, dout))

    # every rank: the whole batch in one process, float64 (CPU) / float32 (CUDA)
    ref_dt = torch.float64 if device.type == "cpu" else torch.float32
    fq, fk, fv = (x.detach().to(ref_dt).requires_grad_() for x in (q, k, v))
    window = tuple(case.get("window", (-1, -1)))
    ref = _reference(fq, fk, fv, cu, case["causal"], window, ref_dt)
    ref.backward(dout.to(ref_dt))
    # and cubeattn over the whole batch in the input dtype
    oq, ok, ov = (x.detach().clone().requires_grad_() for x in (q, k, v))
    maxlen = max(case["seqlens"])
    one = cubeattn.flash_attn_varlen_func(oq, ok, ov, cu, cu, maxlen, maxlen, causal=case["causal"],
                                          window_size=window)
    one.backward(dout)

    # this rank's shard through the zigzag layer
    # `full`: the layer is given the full cu_seqlens (any lengths); else the local ones tell them
    full = case.get("full", False)
    local_cu = cubeattn.zigzag_cu_seqlens(cu, w, r if full else None)
    lq, lk, lv = (cubeattn.zigzag_split(x, cu, r, w).detach().clone().requires_grad_() for x in (q, k, v))
    ldout = cubeattn.zigzag_split(dout, cu, r, w)
    lmax = int(np.diff(local_cu).max())
    out = cubeattn.zigzag_llama3_flash_attn_varlen_func(lq, lk, lv, local_cu, local_cu, lmax, lmax,
                                                        case["stride"], causal=case["causal"], window_size=window,
                                                        group=group, full_cu_seqlens=cu if full else None,
                                                        keep_gathered_kv=case.get("keep", False))
    out.backward(ldout)

    res = {}
    for name, got, want_ref, want_one in (("out", out, ref, one), ("dq", lq.grad, fq.grad, oq.grad),
                                          ("dk", lk.grad, fk.grad, ok.grad), ("dv", lv.grad, fv.grad, ov.grad)):
        whole_ref, whole_one = want_ref.detach(), want_one.detach()
        want_ref = cubeattn.zigzag_split(whole_ref, cu, r, w)
        want_one = cubeattn.zigzag_split(whole_one, cu, r, w)
        if got.shape != want_ref.shape or got.dtype != dt:
            res[f"{name}_shape"] = float("inf")
            continue
        res[f"{name}_vs_ref"] = _rel(got, want_ref, whole_ref)
        res[f"{name}_vs_one"] = _rel(got, want_one, whole_one)
        diff = (got.double() - want_ref.double()).abs()
        res[f"{name}_max_abs"] = diff.max().item() if diff.numel() else 0.0
        res[f"{name}_mean_abs"] = diff.mean().item() if diff.numel() else 0.0
    return res


def error_checks(device, group=None):
    """Bad input that every rank of the group gets, so every rank raises before a collective: the
    exception and the argument it names, as failure strings (none when all is well)."""
    import numpy as np
    import torch
    import torch.distributed as dist

    import cubeattn

    w = dist.get_world_size(group)
    f = cubeattn.zigzag_llama3_flash_attn_varlen_func
    bad = []

    def expect(exc, pattern, n, local, **kw):
        import re

        q = torch.randn(n, 2, 8, device=device)
        try:
            f(q, q[:, :1], q[:, :1], local, local, n, n, 1, group=group, **kw)
        except exc as e:
            if not re.search(pattern, str(e)):
                bad.append(f"{kw or local}: {type(e).__name__} {e} does not match {pattern!r}")
            return
        except Exception as e:
            bad.append(f"{kw or local}: {type(e).__name__} {e}, expected {exc.__name__}")
            return
        bad.append(f"{kw or local}: no exception, expected {exc.__name__} {pattern!r}")

    one = np.array([0, 1], np.int32)
    if w > 1:  # without full_cu_seqlens a local sequence of odd length cannot be split in two equal chunks
        expect(ValueError, "`cu_seqlens_q`.*local sequence 0 has 3 tokens.*`full_cu_seqlens`", 3,
               np.array([0, 3], np.int32))
    # 40 tokens give every rank of W <= 8 at least 4 (two chunks of 2 or more), none a 1-token shard
    expect(ValueError, "`cu_seqlens_q`.*is not rank", 1, one, full_cu_seqlens=np.array([0, 40], np.int32))
    expect(ValueError, "`full_cu_seqlens`", 1, one, full_cu_seqlens=np.array([0, 13, 4], np.int32))
    expect(ValueError, "`window_size`", 1, one, full_cu_seqlens=one * w, window_size=(3, -5))
    return bad


def failures(res, dtype_name):
    """The checks of `res` over their bound, as strings."""
    bad = []
    for key, val in res.items():
        if key.endswith("_shape"):
            bad.append(f"{key}: wrong shape or dtype")
            continue
        for kind in ("ref", "one"):
            if key.endswith(f"_vs_{kind}"):
                fwd, bwd = TOL[dtype_name][kind]
                bound = fwd if key.startswith("out") else bwd
                if not (val <= bound):  # NaN fails too
                    bad.append(f"{key} = {val:.3e} > {bound:.0e}")
    return bad


def _worker(rank, world_size, port, dtype_name, result_path):
    """One CPU process: gloo group, all cases, results (or the exception) as JSON."""
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = {"rank": rank, "cases": []}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        for i, case in enumerate(cpu_cases(world_size)):
            out["cases"].append({"case": case, "res": run_case(case, dtype_name, torch.device("cpu"), seed=i)})
        out["error_checks"] = error_checks(torch.device("cpu"))
    except Exception as e:  # reported by the parent
        import traceback

        out["error"] = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    finally:
        with open(result_path, "w") as f:
            json.dump(out, f)
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn_entry(rank, world_size, port, dtype_name, result_dir):
    _worker(rank, world_size, port, dtype_name, os.path.join(result_dir, f"rank{rank}.json"))


def spawn_main(world_size, dtype_name, result_dir):
    """Spawns `world_size` CPU processes (gloo); returns their result dicts, rank order."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawn_entry, args=(world_size, port, dtype_name, result_dir), nprocs=world_size, join=True)
    results = []
    for r in range(world_size):
        with open(os.path.join(result_dir, f"rank{r}.json")) as f:
            results.append(json.load(f))
    return results


def main(argv=None):
    """torchrun entry: one process per GPU (NCCL) or per CPU process (gloo)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(TOL))
    p.add_argument("--backend", default=None, help="nccl (default with GPUs) or gloo")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="tensors on CUDA (auto: with GPUs, unless --backend gloo) or the CPU; "
                        "--backend gloo --device cuda runs every rank's kernels on CUDA with gloo "
                        "collectives, more ranks than GPUs sharing them (one GPU can host W = 1..4)")
    p.add_argument("--json", default=None, help="rank 0 writes all ranks' results here")
    args = p.parse_args(argv)
    import torch
    import torch.distributed as dist

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available() and args.backend != "gloo")
    backend = args.backend or ("nccl" if cuda else "gloo")
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    gpu = local % max(torch.cuda.device_count(), 1)
    if cuda:
        torch.cuda.set_device(gpu)
    dist.init_process_group(backend)
    w = dist.get_world_size()
    device = torch.device("cuda", gpu) if cuda else torch.device("cpu")
    dtype = args.dtype if cuda else "float32"
    cases_for = gpu_cases if cuda else cpu_cases
    # W = 1..world: a subgroup of the first n ranks (W = 3 on four GPUs); every rank joins new_group
    mine, bad = [], []
    for n in range(1, w + 1):
        sub = dist.new_group(list(range(n)))
        if rank < n:
            for i, case in enumerate(cases_for(n)):
                res = run_case(case, dtype, device, group=sub, seed=i)
                mine.append({"W": n, "case": case, "res": res})
                bad += [f"rank {rank} W={n} case {i} {case}: {b}" for b in failures(res, dtype)]
            bad += [f"rank {rank} W={n} error check: {b}" for b in error_checks(device, sub)]
        dist.barrier()
    everything = [None] * w
    dist.all_gather_object(everything, {"rank": rank, "runs": mine, "bad": bad})
    if rank == 0:
        nbad = sum(len(e["bad"]) for e in everything)
        for e in everything:
            for b in e["bad"]:
                print("FAIL", b)
        checks = sum(len(r["res"]) for e in everything for r in e["runs"])
        print(f"zigzag: {w} ranks, {dtype}, {sum(len(e['runs']) for e in everything)} (rank, W, case) runs, "
              f"{nbad} failed checks of {checks} values")
        worst = {}
        for e in everything:
            for r in e["runs"]:
                for key, val in r["res"].items():
                    worst[key] = max(worst.get(key, 0.0), val)
        print(json.dumps({k: float(f"{v:.3e}") for k, v in sorted(worst.items())}))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(everything, f, indent=1)
    ok = not bad
    flags = [None] * w
    dist.all_gather_object(flags, ok)
    dist.destroy_process_group()
    return 0 if all(flags) else 1


if __name__ == "__main__":
    sys.exit(main())
