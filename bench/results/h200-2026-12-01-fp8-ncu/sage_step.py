"""Four FP8 sage calls (B4 H32 d128 bf16, S from the environment, default 8K; CAUSAL=1 for
causal) for ncu: `sageattn(..., quant_gran="per_warp", pv_precision="fp8")`, synced."""
import os
import torch
import cubeattn
s = int(os.environ.get("S", "8192"))
causal = os.environ.get("CAUSAL", "0") == "1"
q, k, v = (torch.randn(4, s, 32, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for _ in range(4):
    cubeattn.sageattn(q, k, v, is_causal=causal, quant_gran="per_warp", pv_precision="fp8")
    torch.cuda.synchronize()
