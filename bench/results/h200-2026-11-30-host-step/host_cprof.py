"""Where the host time of a torch-path fwd+bwd step goes on the GPU machine (ours vs SDPA cuDNN):
per phase host times (no sync inside a step), then cProfile of 200 synced steps (top by tottime),
and the time from the step's start to its first GPU work (an event recorded before the call vs
the first kernel: torch.profiler)."""
import os, time, statistics, cProfile, pstats, io, torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import cubeattn
S = int(os.environ.get("S", "8192")); causal = True
hq, hkv, d = 32, 8, 128
g = torch.Generator(device="cuda").manual_seed(S)
q = torch.randn(1, S, hq, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
k = torch.randn(1, S, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
v = torch.randn(1, S, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
go = torch.randn_like(q)
q4, k4, v4 = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
go4 = go.transpose(1, 2)
def ours():
    cubeattn.flash_attn_func(q, k, v, causal=causal).backward(go)
def cudnn():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal, enable_gqa=True)
    o.backward(go4)
for name, f in (("cubeattn", ours), ("sdpa_cudnn", cudnn)):
    for _ in range(20): f()
    torch.cuda.synchronize()
    walls = []
    for _ in range(50):
        t0 = time.perf_counter(); f(); torch.cuda.synchronize(); walls.append(time.perf_counter() - t0)
    # host time until the first GPU work: mark the host time, then events around
    lat = []
    for _ in range(30):
        torch.cuda.synchronize()
        e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True)
        e0.record(); t0 = time.perf_counter(); f(); t1 = time.perf_counter(); e1.record(); torch.cuda.synchronize()
        lat.append((t1 - t0, e0.elapsed_time(e1)))
    print(f"== {name} S={S}: wall {statistics.median(walls)*1e3:.3f} ms; host call (fwd+bwd, no sync) {statistics.median([a for a,_ in lat])*1e3:.3f} ms; events around {statistics.median([b for _,b in lat]):.3f} ms", flush=True)
    pr = cProfile.Profile(); pr.enable()
    for _ in range(200):
        f(); torch.cuda.synchronize()
    pr.disable(); s = io.StringIO(); st = pstats.Stats(pr, stream=s); st.sort_stats("tottime").print_stats(22)
    print("\n".join(l for l in s.getvalue().splitlines() if l.strip())[:6000], flush=True)
