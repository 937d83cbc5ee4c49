"""Kernel durations of decode steps (torch.profiler, CUDA activity), per kernel name, for B x Sk at D."""
import os, torch, cubeattn
from torch.profiler import profile, ProfilerActivity
tag = os.environ.get("TAGX", "x"); D = int(os.environ.get("D", "128"))
for b, sk in ((8, 4096), (1, 32768), (8, 16384)):
    g = torch.Generator(device="cuda").manual_seed(sk)
    q = torch.randn(b, 1, 32, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, sk, 8, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, sk, 8, D, device="cuda", dtype=torch.bfloat16, generator=g)
    for _ in range(20): cubeattn.flash_attn_func(q, k, v)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(50):
            cubeattn.flash_attn_func(q, k, v)
        torch.cuda.synchronize()
    ev = [e for e in p.events() if e.device_type.name == "CUDA"]
    agg = {}
    for e in ev:
        a = agg.setdefault(e.name[:40], [0, 0.0]); a[0] += 1; a[1] += e.device_time
    ts = sorted((e.time_range.start, e.time_range.end) for e in ev)
    span = (ts[-1][1] - ts[0][0]) / 50
    print(f"{tag} D{D} B{b} Sk{sk}: per step {span:.1f} us; " + "; ".join(f"{n} {t/c:.1f}us x{c//50}" for n, (c, t) in sorted(agg.items(), key=lambda x: -x[1][1])), flush=True)
