"""Host microseconds of the pieces of a torch-path forward (grad and no-grad) and backward, on the GPU machine:
medians of wrapped calls (torch.empty / empty_like, _core.forward_device / backward_device, _Attention.apply, the whole call),
at S = 128, 1K, 8K (Llama3-8B heads, d128, bf16, causal). Each step synced."""
import os, time, statistics, torch, cubeattn
from cubeattn import _core, _autograd
T = {}
def wrap(obj, name, label):
    f0 = getattr(obj, name)
    def g(*a, **kw):
        t = time.perf_counter(); r = f0(*a, **kw); T.setdefault(label, []).append(time.perf_counter() - t); return r
    setattr(obj, name, g)
    return f0
wrap(_core, "forward_device", "rust forward_device")
wrap(_core, "backward_device", "rust backward_device")
emp = torch.empty; eml = torch.empty_like
def empty(*a, **kw):
    t = time.perf_counter(); r = emp(*a, **kw); n = r.numel() * r.element_size()
    T.setdefault(f"torch.empty {'>=1MB' if n >= 1 << 20 else '<1MB'}", []).append(time.perf_counter() - t); return r
def empty_like(*a, **kw):
    t = time.perf_counter(); r = eml(*a, **kw); T.setdefault("torch.empty_like", []).append(time.perf_counter() - t); return r
torch.empty = empty; torch.empty_like = empty_like
ap = _autograd._Attention.apply
def apply(*a):
    t = time.perf_counter(); r = ap(*a); T.setdefault("_Attention.apply (fwd incl.)", []).append(time.perf_counter() - t); return r
_autograd._Attention.apply = apply
hq, hkv, d = 32, 8, 128
for S in (128, 1024, 8192):
    g = torch.Generator(device="cuda").manual_seed(S)
    mk = lambda h: torch.randn(1, S, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = mk(hq).requires_grad_(), mk(hkv).requires_grad_(), mk(hkv).requires_grad_()
    go = torch.randn_like(q)
    for grad in (False, True):
        def step():
            if grad:
                t0 = time.perf_counter(); o = cubeattn.flash_attn_func(q, k, v, causal=True); t1 = time.perf_counter()
                o.backward(go); t2 = time.perf_counter()
                T.setdefault("fwd call", []).append(t1 - t0); T.setdefault("bwd call (run_backward)", []).append(t2 - t1)
            else:
                with torch.no_grad():
                    t0 = time.perf_counter(); o = cubeattn.flash_attn_func(q, k, v, causal=True); t1 = time.perf_counter()
                T.setdefault("fwd call", []).append(t1 - t0)
            torch.cuda.synchronize()
        for _ in range(30): step()
        T.clear()
        for _ in range(200): step()
        print(f"== S={S} {'grad' if grad else 'no_grad'}: " + "; ".join(f"{k} {statistics.median(v)*1e6:.1f} us x{len(v)//200}" for k, v in T.items()), flush=True)
# torch.empty alone
for n in (1 << 10, 1 << 20, 64 << 20, 160 << 20):
    for _ in range(50): emp(n, dtype=torch.uint8, device="cuda")
    ts = []
    for _ in range(200):
        t = time.perf_counter(); x = emp(n, dtype=torch.uint8, device=q.device); ts.append(time.perf_counter() - t); del x
    print(f"torch.empty({n} B) alone: {statistics.median(ts)*1e6:.1f} us", flush=True)
