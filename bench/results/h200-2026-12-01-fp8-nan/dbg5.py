"""Which bytes of an FP8 P.V call's workspace are read without being written: the workspace
(torch.empty of uint8) zero-filled except one 256-byte chunk of 0xFF bytes (NaN in e4m3), one
call per chunk; prints the chunks whose poison reaches the output, named by the workspace parts
(`sparse::forward_workspace`: the flag part, then `sparse_int8::parts`, each rounded up to 256)."""
import torch, cubeattn
_empty = torch.empty
poison = {"at": None}

def empty(*a, **k):
    t = _empty(*a, **k)
    if t.is_cuda and t.dtype == torch.uint8:
        t.zero_()
        if poison["at"] is not None and poison["at"] < t.numel():
            t[poison["at"]:poison["at"] + 256] = 255
        poison["n"] = t.numel()
    return t
torch.empty = empty

def parts(tq, tk, hq, hkv, hd, b=1):
    nv = b * hkv * hd
    ch = -(-tk // 64)
    row = -(-(tk + 80 * b) // 16) * 16
    names = ["q8", "k8", "qscale+lse_corr+vscale", "kscale", "amax", "ksums", "kmean", "vt", "vmax_chunks"]
    sizes = [tq * hq * hd, tk * hkv * hd, (2 * hq * tq + 2 * nv) * 4, tk * hkv * 4, max(hq * tq, hkv * tk) * 4,
             ch * b * hkv * hd * 4, b * hkv * hd * 4, hkv * hd * row, ch * nv * 4]
    out, at = [("flag", 0, 256)], 256
    for n, s in zip(names, sizes):
        r = -(-max(s, 1) // 256) * 256
        out.append((n, at, at + r))
        at += r
    return out, at

torch.manual_seed(1)
for sk in (64, 520):
    q = _empty(1, 64, 8, 128, device="cuda", dtype=torch.bfloat16).normal_()
    k = _empty(1, sk, 2, 128, device="cuda", dtype=torch.bfloat16).normal_()
    v = _empty(1, sk, 2, 128, device="cuda", dtype=torch.bfloat16).normal_()
    poison["at"] = None
    o = cubeattn.sageattn(q, k, v, quant_gran="per_block", pv_precision="fp8")
    n = poison["n"]
    layout, total = parts(64, sk, 8, 2, 128)
    print(f"Sk={sk}: workspace {n} bytes (parts sum {total}), zero-filled call nonfinite {int((~torch.isfinite(o.float())).sum())}", flush=True)
    hits = []
    for at in range(0, n, 256):
        poison["at"] = at
        o = cubeattn.sageattn(q, k, v, quant_gran="per_block", pv_precision="fp8")
        bad = int((~torch.isfinite(o.float())).sum())
        if bad:
            name = next((f"{p} +{at - a}" for p, a, e in layout if a <= at < e), "?")
            hits.append(f"{at} ({name}): {bad}")
    poison["at"] = None
    print(f"  poisoned chunks reaching the output ({len(hits)}):", flush=True)
    for h in hits[:60]:
        print("   ", h, flush=True)
