"""(MLA variant: heads 16 / 16, v 128 wide, causal.) Where a torch-path forward call's time goes, ours (flash_attn_func) vs SDPA cuDNN, Llama3-8B heads
32/8 bf16 B=1 non-causal (SHAPES="S:D ..."): per-call-synced wall median (as the benches time),
wall per call over 20 calls with one sync, host time of the call, and a torch.profiler cycle of
3 synced calls (every GPU kernel with its duration and the gap before it)."""
import os, time, statistics, torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import profile, ProfilerActivity
import cubeattn
SHAPES = [tuple(int(x) for x in p.split(":")) for p in os.environ.get("SHAPES", "4096:128 8192:128 16384:128 4096:64").split()]
med = lambda x: statistics.median(x) * 1e3
sync = torch.cuda.synchronize
for S, d in SHAPES:
    g = torch.Generator(device="cuda").manual_seed(S)
    q = torch.randn(1, S, 16, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, S, 16, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, S, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    def ours():
        return cubeattn.flash_attn_func(q, k, v, causal=True)
    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    fns = (("cubeattn", ours), ("sdpa_cudnn", cudnn))
    for _, f in fns:
        for _ in range(10):
            f()
    sync()
    res = {n: dict(synced=[], host=[], batch=[]) for n, _ in fns}
    for r in range(6):  # in turns
        for n, f in (fns if r % 2 == 0 else fns[::-1]):
            for _ in range(10):
                t0 = time.perf_counter(); f(); t1 = time.perf_counter(); sync(); t2 = time.perf_counter()
                res[n]["synced"].append(t2 - t0); res[n]["host"].append(t1 - t0)
            t0 = time.perf_counter()
            for _ in range(20):
                f()
            sync(); res[n]["batch"].append((time.perf_counter() - t0) / 20)
    for n, f in fns:
        x = res[n]
        print(f"== {n} S={S} d={d}: synced {med(x['synced']):.3f} ms | 20 calls one sync {med(x['batch']):.3f} ms/call | host {med(x['host']) * 1e3:.1f} us", flush=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                f(); sync()
        ev = prof.events()
        gpu = sorted([e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA], key=lambda e: e.time_range.start)
        n3 = len(gpu) // 3
        prev = None
        for e in gpu[-n3:] if n3 else gpu:
            gap = (e.time_range.start - prev) / 1e3 if prev is not None else 0.0
            print(f"   gap {gap:7.3f}  {(e.time_range.end - e.time_range.start) / 1e3:7.3f} ms  {e.name[:80]}")
            prev = e.time_range.end
        api = {}
        for e in ev:
            if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith(("cu", "cuda")):
                c = api.setdefault(e.name, [0.0, 0]); c[0] += (e.time_range.end - e.time_range.start) / 3; c[1] += 1
        for nm, (t, c) in sorted(api.items(), key=lambda x: -x[1][0])[:8]:
            print(f"   api {nm[:50]:50s} {t:9.1f} us/call x{c / 3:.0f}")
    del q, k, v, qt, kt, vt
