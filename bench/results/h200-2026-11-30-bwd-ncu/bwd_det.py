"""deterministic=True backward repeated (the ws kernel without dQ + the dQ pass), for ncu: S, D, CAUSAL."""
import os, torch, cubeattn
s, d, causal = int(os.environ.get("S", "8192")), int(os.environ.get("D", "128")), os.environ.get("CAUSAL", "0") == "1"
g = torch.Generator(device="cuda").manual_seed(0)
mk = lambda h: torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
q, k, v, go = mk(32), mk(8), mk(8), mk(32)
for x in (q, k, v): x.requires_grad_(True)
for _ in range(4):
    cubeattn.flash_attn_func(q, k, v, causal=causal, deterministic=True).backward(go)
torch.cuda.synchronize()
