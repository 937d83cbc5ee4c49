"""torch-path fwd+bwd step (flash_attn_func(...).backward(go), synced per step; median ms) beside SDPA cuDNN, Llama3-8B heads d128 bf16, B=1;
TAGX names the Python build. Also the no-grad forward."""
import os, time, statistics, json, torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import cubeattn
tag = os.environ.get("TAGX", "x"); rows = []
def med(f, n=60, warm_s=0.3):
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warm_s: f()
    torch.cuda.synchronize(); ts = []
    for _ in range(n):
        t = time.perf_counter(); f(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3
for S in (1024, 4096, 8192):
    for causal in (True, False):
        g = torch.Generator(device="cuda").manual_seed(S)
        mk = lambda h: torch.randn(1, S, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        q, k, v = mk(32).requires_grad_(), mk(8).requires_grad_(), mk(8).requires_grad_()
        go = torch.randn_like(q)
        q4, k4, v4 = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v)); go4 = go.transpose(1, 2)
        def ours(): cubeattn.flash_attn_func(q, k, v, causal=causal).backward(go)
        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal, enable_gqa=True)
            o.backward(go4)
        res = dict(cubeattn=med(ours), sdpa_cudnn=med(cudnn))
        for impl, ms in res.items():
            rows.append(dict(what="dense_fwdbwd", impl=impl, variant=tag, S=S, D=128, causal=causal, ms=ms))
        print(f"{tag:5s} S{S:5d} causal={causal!s:5s}: ours {res['cubeattn']:.3f}  cudnn {res['sdpa_cudnn']:.3f}  ratio {res['cubeattn']/res['sdpa_cudnn']:.3f}", flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), f"step_{tag}_{os.getpid()}.json"), "w"), indent=1)
