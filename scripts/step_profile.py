"""Usage: python scripts/step_profile.py (D=64 for head_dim 64; SHAPES="4096:0 8192:1" for other
S:causal pairs), on a CUDA machine with torch and cubeattn.
Where a torch-path fwd+bwd step's time goes (ours vs SDPA cuDNN), Llama3-8B heads 32/8 d128 bf16 B=1:
per-call-synced wall median; host time of the forward call and of .backward() (no sync); a torch.profiler
cycle of one step: the GPU timeline with gaps, top CPU ops, and every sync / copy / alloc driver call."""
import os, time, statistics, torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import profile, ProfilerActivity
import cubeattn
from cubeattn import _core
TIMES = {}
def _wrap(name):
    f = getattr(_core, name)
    def g(*a, **kw):
        t = time.perf_counter(); r = f(*a, **kw); TIMES.setdefault(name, []).append(time.perf_counter() - t); return r
    setattr(_core, name, g)
for _n in ("forward_device", "backward_device", "device_workspace"):
    if hasattr(_core, _n):
        _wrap(_n)
D = int(os.environ.get("D", "128"))
SHAPES = [tuple(int(x) for x in p.split(":")) for p in os.environ.get("SHAPES", "4096:1 8192:1 8192:0").split()]
for S, causal in [(s, bool(c)) for s, c in SHAPES]:
    hq, hkv, d = 32, 8, D
    g = torch.Generator(device="cuda").manual_seed(S)
    q = torch.randn(1, S, hq, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(1, S, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(1, S, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    go = torch.randn_like(q)
    q4, k4, v4 = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    go4 = go.transpose(1, 2)
    def f_ours():
        return cubeattn.flash_attn_func(q, k, v, causal=causal), go
    def f_cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal, enable_gqa=True), go4
    for name, f in (("cubeattn", f_ours), ("sdpa_cudnn", f_cudnn)):
        for _ in range(5):
            o, gg = f(); o.backward(gg)
        torch.cuda.synchronize()
        walls, hf, hb, wt = [], [], [], []
        TIMES.clear()
        for _ in range(30):
            t0 = time.perf_counter(); o, gg = f(); t1 = time.perf_counter(); o.backward(gg); t2 = time.perf_counter()
            torch.cuda.synchronize(); t3 = time.perf_counter()
            walls.append(t3 - t0); hf.append(t1 - t0); hb.append(t2 - t1); wt.append(t3 - t2)
        med = lambda x: statistics.median(x) * 1e3
        print(f"== {name} S={S} causal={causal}: wall {med(walls):.3f} ms | host fwd call {med(hf):.3f} bwd call {med(hb):.3f} | sync wait {med(wt):.3f}", flush=True)
        for nm, ts in TIMES.items():
            print(f"   rust {nm}: median {med(ts):.3f} ms x{len(ts)}")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                o, gg = f(); o.backward(gg)
                torch.cuda.synchronize()
        ev = prof.events()
        gpu = sorted([e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA], key=lambda e: e.time_range.start)
        # the last step's kernels: after the last big gap
        n = len(gpu) // 3
        last = gpu[-n:] if n else gpu
        t0 = last[0].time_range.start if last else 0
        prev = t0
        for e in last:
            print(f"   + {(e.time_range.start - t0) / 1e3:8.3f} ms gap {(e.time_range.start - prev) / 1e3:7.3f}  {(e.time_range.end - e.time_range.start) / 1e3:7.3f} ms  {e.name[:70]}")
            prev = e.time_range.end
        cpu = {}
        for e in ev:
            if e.device_type == torch.autograd.DeviceType.CPU:
                c = cpu.setdefault(e.name, [0.0, 0])
                c[0] += (e.time_range.end - e.time_range.start) / 1e3 / 3; c[1] += 1
        for nm, (t, c) in sorted(cpu.items(), key=lambda x: -x[1][0])[:14]:
            print(f"   cpu {nm[:60]:60s} {t:8.3f} ms/step x{c / 3:.0f}")
        for nm, (t, c) in sorted(cpu.items()):
            if any(s in nm for s in ("ynchron", "Memcpy", "cuMemAlloc", "cuMemFree", "cudaMalloc", "cudaFree", "EventSync", "StreamWait", "cuCtx", "cuStream", "cuMemcpy", "cuMemset", "cudaMemset")):
                print(f"   sync? {nm[:60]:60s} {t:8.3f} ms/step x{c / 3:.0f}")
    del q, k, v, go, q4, k4, v4, go4
