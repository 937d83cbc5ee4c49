"""Which workspace parts an FP8 P.V call writes: the workspace (torch.empty of uint8) zero-filled
and kept, then after one call the non-zero bytes of each part (`dbg5.parts`); also the output
against the INT8 call."""
import torch, cubeattn
_empty = torch.empty
kept = {}

def empty(*a, **k):
    t = _empty(*a, **k)
    if t.is_cuda and t.dtype == torch.uint8:
        t.zero_()
        kept["ws"] = t
    return t
torch.empty = empty


def parts(tq, tk, hq, hkv, hd, b=1):
    nv = b * hkv * hd
    ch = -(-tk // 64)
    row = -(-(tk + 80 * b) // 16) * 16
    names = ["q8", "k8", "qscale+lse_corr+vscale", "kscale", "amax", "ksums", "kmean", "vt", "vmax_chunks"]
    sizes = [tq * hq * hd, tk * hkv * hd, (2 * hq * tq + 2 * nv) * 4, tk * hkv * 4, max(hq * tq, hkv * tk) * 4,
             ch * b * hkv * hd * 4, b * hkv * hd * 4, hkv * hd * row, ch * nv * 4]
    out, at = [("flag", 0, 256, 256)], 256
    for n, s in zip(names, sizes):
        r = -(-max(s, 1) // 256) * 256
        out.append((n, at, at + r, s))
        at += r
    return out, at

torch.manual_seed(1)
for sk in (64, 520, 128):
    q = _empty(1, 64, 8, 128, device="cuda", dtype=torch.bfloat16).normal_()
    k = _empty(1, sk, 2, 128, device="cuda", dtype=torch.bfloat16).normal_()
    v = _empty(1, sk, 2, 128, device="cuda", dtype=torch.bfloat16).normal_()
    ref = cubeattn.sageattn(q, k, v, quant_gran="per_block").float()
    o = cubeattn.sageattn(q, k, v, quant_gran="per_block", pv_precision="fp8").float()
    torch.cuda.synchronize()
    ws = kept["ws"]
    layout, total = parts(64, sk, 8, 2, 128)
    print(f"Sk={sk}: ws {ws.numel()} bytes at {ws.data_ptr():#x} (parts {total}); fp8 vs int8 max diff "
          f"{float((o - ref).abs().max()):.4f}, nonfinite {int((~torch.isfinite(o)).sum())}")
    for name, a, e, s in layout:
        nz = int((ws[a:a + s] != 0).sum())
        print(f"   {name:24s} [{a:7d}, {a + s:7d}) non-zero bytes {nz} of {s}")
