"""One MLA 192/128 fwd+bwd (16/16 heads, bf16, 8K; CAUSAL=0 for non-causal), run twice: the
kernels the second call launches are the ones ncu profiles (--launch-skip 1)."""
import os, torch, cubeattn
causal = os.environ.get("CAUSAL", "1") == "1"
g = torch.Generator(device="cuda").manual_seed(0)
mk = lambda d: torch.randn(1, 8192, 16, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
q, k, v = mk(192), mk(192), mk(128)
do = torch.randn(1, 8192, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g)
for _ in range(2):
    out = cubeattn.flash_attn_func(q, k, v, causal=causal)
    out.backward(do)
torch.cuda.synchronize()
