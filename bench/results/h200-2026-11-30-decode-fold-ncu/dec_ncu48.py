"""Decode steps (Sq=1, GQA 32/8, d128, bf16) through flash_attn_func at B x SK from the environment, repeated: for ncu."""
import os, torch, cubeattn
b, sk = int(os.environ.get("B", "8")), int(os.environ.get("SK", "4096"))
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
k = torch.randn(b, sk, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
v = torch.randn(b, sk, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
for _ in range(8):
    cubeattn.flash_attn_func(q, k, v)
torch.cuda.synchronize()
