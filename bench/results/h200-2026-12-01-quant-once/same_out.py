"""Whether two builds give the same INT8 / FP8 results to the bit. `same_out.py run FILE.npz`: small
calls (torch CUDA tensors, fixed seeds) whose out and lse depend on the quantised Q / K only
through `int8_quantize`'s int8 words, scales and LSE corrections (the forward kernels are the same
code in both builds): `sageattn` (bf16, GQA 8 / 2, d128, ragged lengths, causal and not, every
granularity, smoothing on and off, P.V in bf16 and FP8) and `block_sparse_attn_func` with INT8
Q K^T (f16 and bf16, d64 and d128, odd and multi-tile blocks: 16 / 48 / 100 / 256 query rows,
16 / 80 / 200 / 256 keys, random index); each call twice (`repeatable`: the same bytes both
times). Saves the raw bytes. `same_out.py compare A.npz B.npz`: per call, identical or how many
elements differ; exit 1 if any differ."""
import sys
import numpy as np


def cases(torch, cubeattn):
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(7)
    for dt in (torch.bfloat16,):
        for sq, sk, causal in ((700, 700, True), (333, 513, False)):
            q, k, v = (torch.randn(2, s, h, 128, device=dev, dtype=dt, generator=g) for s, h in ((sq, 8), (sk, 2), (sk, 2)))
            k = k + 3.0 * torch.randn(128, device=dev, dtype=dt, generator=g)  # a channel offset: smoothing matters
            for gran in ("per_block", "per_warp", "per_thread"):
                for smooth in (True, False):
                    for pv in (None, "fp8"):
                        name = f"sage_{str(dt)[6:]}_{sq}x{sk}_c{int(causal)}_{gran}_s{int(smooth)}_{pv}"
                        yield name, lambda q=q, k=k, v=v, c=causal, gr=gran, sm=smooth, pv=pv: cubeattn.sageattn(
                            q, k, v, is_causal=c, quant_gran=gr, smooth_k=sm, pv_precision=pv, return_lse=True, device="cuda")
    rng = np.random.default_rng(11)
    B, sq, sk, hq, hkv = 2, 300, 517, 4, 2
    # 64-row tiles (48-row Q blocks, 16-key blocks), two tiles a block (200 keys), two tiles with
    # one scale a block (256: the extra max pass)
    for d, qb, kb, dt in ((128, 48, 80, torch.bfloat16), (128, 256, 256, torch.float16), (64, 100, 200, torch.float16),
                          (64, 16, 16, torch.bfloat16)):
        q, k, v = (torch.randn(B, s, h, d, device=dev, dtype=dt, generator=g) for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
        k = k + 3.0 * torch.randn(d, device=dev, dtype=dt, generator=g)
        qbn, kbn = -(-sq // qb), -(-sk // kb)
        ix = -np.ones((B, hq, qbn, kbn), np.int32)
        for b in range(B):
            for h in range(hq):
                for i in range(qbn):
                    keep = rng.permutation(kbn)[: max(1, kbn // 2)]
                    ix[b, h, i, : len(keep)] = keep
        ixt = torch.from_numpy(ix)
        for gran in ("per_block", "per_warp", "per_thread"):
            for smooth in (True, False):
                causal = (qb + len(gran) + smooth) % 2 == 0
                name = f"sparse_d{d}_{qb}x{kb}_{str(dt)[6:]}_c{int(causal)}_{gran}_s{int(smooth)}"
                yield name, lambda q=q, k=k, v=v, ix=ixt, qb=qb, kb=kb, c=causal, gr=gran, sm=smooth: cubeattn.block_sparse_attn_func(
                    q, k, v, ix, q_block=qb, k_block=kb, causal=c, quant_gran=gr, smooth_k=sm, return_lse=True, device="cuda")


def raw(torch, t):
    t = t.detach().contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return t.cpu().numpy()


def run(path):
    import torch
    import cubeattn
    res = {}
    bad = 0
    for name, fn in cases(torch, cubeattn):
        try:
            out, lse = fn()
            again, again_lse = fn()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 (reported, the other calls still run)
            print(f"{name}: ERROR {type(e).__name__}: {e}")
            bad += 1
            continue
        o, l = raw(torch, out), raw(torch, lse)
        rep = np.array_equal(o, raw(torch, again)) and np.array_equal(l, raw(torch, again_lse))
        bad += not rep
        res[name + "/out"], res[name + "/lse"] = o, l
        print(f"{name}: repeatable {rep}, finite {bool(torch.isfinite(out).all())}, backend {cubeattn.last_backend()}")
    np.savez(path, **res)
    print(f"{len(res) // 2} calls, {bad} not repeatable or failed")


def compare(a, b):
    A, B = np.load(a), np.load(b)
    names = sorted(set(A.files) | set(B.files))
    diff = 0
    for n in names:
        if n not in A.files or n not in B.files:
            print(f"{n}: only in one file")
            diff += 1
            continue
        x, y = A[n], B[n]
        if x.shape != y.shape:
            print(f"{n}: shapes {x.shape} {y.shape}")
            diff += 1
        elif not np.array_equal(x, y):
            print(f"{n}: {int((x != y).sum())} of {x.size} elements differ")
            diff += 1
    print(f"compare: {len(names)} arrays, {diff} differ")
    return diff


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2])
    else:
        sys.exit(1 if compare(sys.argv[2], sys.argv[3]) else 0)
