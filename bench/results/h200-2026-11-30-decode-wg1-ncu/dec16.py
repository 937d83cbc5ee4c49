"""Decode step shapes for ncu: B=8 Sq=1 Sk=16K (and 4K), GQA 32/8, d128, bf16, flash_attn_func, repeated."""
import os, torch, cubeattn
sk = int(os.environ.get("SK", "16384"))
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(8, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
k = torch.randn(8, sk, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
v = torch.randn(8, sk, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
for _ in range(8):
    cubeattn.flash_attn_func(q, k, v)
torch.cuda.synchronize()
