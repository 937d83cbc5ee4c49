"""Small INT8 + FP8 P.V sageattn calls for compute-sanitizer (the switch CUBEATTN_CUDA_SAGE_POLY
from the environment): GQA 8 / 2 heads, d128, 700 and 333 tokens (ragged last tiles), causal and
not, every granularity, each against SDPA's math path in f32 (cosine >= 0.999)."""
import torch, torch.nn.functional as F
import cubeattn
g = torch.Generator(device="cuda").manual_seed(3)
worst = 1.0
for s, causal in ((700, True), (333, False)):
    q, k, v = (torch.randn(1, s, h, 128, device="cuda", dtype=torch.bfloat16, generator=g) for h in (8, 2, 2))
    ref = F.scaled_dot_product_attention(*(x.transpose(1, 2).float() for x in (q, k, v)), is_causal=causal,
                                         enable_gqa=True).transpose(1, 2)
    for gran in ("per_block", "per_warp", "per_thread"):
        o = cubeattn.sageattn(q, k, v, is_causal=causal, quant_gran=gran, pv_precision="fp8")
        torch.cuda.synchronize()
        a, b = o.double().flatten(), ref.double().flatten()
        cos = float(a @ b / (a.norm() * b.norm()))
        worst = min(worst, cos)
        print(f"S={s} causal={causal} {gran}: cosine {cos:.6f}")
print(f"worst cosine {worst:.6f}")
assert worst >= 0.999, worst
