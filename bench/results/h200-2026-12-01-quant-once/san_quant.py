"""Small INT8 and INT8 + FP8 P.V calls for compute-sanitizer (memcheck, racecheck: the
quantisation pass's shared maxima and barriers): `sageattn` GQA 8 / 2 heads, d128, 700 and 333
tokens (ragged last tiles), causal and not, every granularity, P.V in bf16 and FP8, each against
SDPA's math path in f32 (cosine >= 0.999); and `block_sparse_attn_func` with INT8 Q K^T on
blocks that take 64-row tiles (48), two tiles (200 keys) and two tiles with one scale a block
(256, the extra max pass), d64 and d128, against the CPU's INT8 path (relative L2 <= 1e-2)."""
import numpy as np
import torch, torch.nn.functional as F
import cubeattn
g = torch.Generator(device="cuda").manual_seed(3)
worst = 1.0
for s, causal in ((700, True), (333, False)):
    q, k, v = (torch.randn(1, s, h, 128, device="cuda", dtype=torch.bfloat16, generator=g) for h in (8, 2, 2))
    ref = F.scaled_dot_product_attention(*(x.transpose(1, 2).float() for x in (q, k, v)), is_causal=causal,
                                         enable_gqa=True).transpose(1, 2)
    for gran in ("per_block", "per_warp", "per_thread"):
        for pv in (None, "fp8"):
            o = cubeattn.sageattn(q, k, v, is_causal=causal, quant_gran=gran, pv_precision=pv)
            torch.cuda.synchronize()
            a, b = o.double().flatten(), ref.double().flatten()
            cos = float(a @ b / (a.norm() * b.norm()))
            worst = min(worst, cos)
            print(f"sage S={s} causal={causal} {gran} {pv}: cosine {cos:.6f}")
rng = np.random.default_rng(5)
worst_rel = 0.0
for d, qb, kb, gran in ((128, 48, 200, "per_warp"), (128, 256, 256, "per_block"), (64, 256, 48, "per_thread"), (64, 100, 256, "per_block")):
    B, sq, sk, hq, hkv = 1, 300, 517, 4, 2
    q, k, v = (torch.randn(B, n, h, d, device="cuda", dtype=torch.float16, generator=g) for n, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    qbn, kbn = -(-sq // qb), -(-sk // kb)
    ix = -np.ones((B, hq, qbn, kbn), np.int32)
    for h in range(hq):
        for i in range(qbn):
            keep = rng.permutation(kbn)[: max(1, kbn // 2)]
            ix[0, h, i, : len(keep)] = keep
    kw = dict(q_block=qb, k_block=kb, causal=True, quant_gran=gran)
    o = cubeattn.block_sparse_attn_func(q, k, v, torch.from_numpy(ix), device="cuda", **kw)
    torch.cuda.synchronize()
    want = cubeattn.block_sparse_attn_func(*(x.cpu().numpy() for x in (q, k, v)), ix, device="cpu", **kw)
    got, want = o.double().cpu().numpy(), np.asarray(want, np.float64)
    rel = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
    worst_rel = max(worst_rel, rel)
    print(f"sparse d{d} {qb}x{kb} {gran}: rel L2 vs cpu {rel:.2e}")
print(f"worst cosine {worst:.6f}, worst rel L2 vs cpu {worst_rel:.2e}")
assert worst >= 0.999 and worst_rel <= 1e-2, (worst, worst_rel)
