"""One forward config repeated, for ncu: IMPL=ours|cudnn, S, D, CAUSAL."""
import os, torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import cubeattn
s, d, causal = int(os.environ.get("S", "8192")), int(os.environ.get("D", "128")), os.environ.get("CAUSAL", "0") == "1"
impl = os.environ.get("IMPL", "ours")
g = torch.Generator(device="cuda").manual_seed(0)
mk = lambda h: torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
q, k, v = mk(32), mk(8), mk(8)
q4, k4, v4 = (x.transpose(1, 2).contiguous() for x in (q, k, v))
for _ in range(4):
    if impl == "ours":
        cubeattn.flash_attn_func(q, k, v, causal=causal)
    else:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal, enable_gqa=True)
torch.cuda.synchronize()
