# Where the torch path's time goes: per step, host time to the first GPU activity, GPU busy time,
# gaps, and each kernel's mean duration; ours beside SDPA cuDNN, same tensors.
import json, os, sys, statistics, time
import torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import profile, ProfilerActivity, record_function
import cubeattn
from cubeattn.bench import median_ms
OUT = os.environ.get("OUT", "/tmp")
sync = torch.cuda.synchronize
def case(name, B, s, hq, hkv, d, causal, bwd):
    q = torch.randn(B, s, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=bwd)
    k = torch.randn(B, s, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=bwd)
    v = torch.randn(B, s, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=bwd)
    go = torch.randn(B, s, hq, d, device="cuda", dtype=torch.bfloat16)
    q4, k4, v4 = (x.detach().transpose(1, 2).contiguous().requires_grad_(bwd) for x in (q, k, v))
    go4 = go.transpose(1, 2).contiguous()
    def ours():
        o = cubeattn.flash_attn_func(q, k, v, causal=causal)
        if bwd: o.backward(go)
    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal, enable_gqa=True)
        if bwd: o.backward(go4)
    cu = [i * s for i in range(B + 1)]
    spec = cubeattn.varlen_spec((B * s, hq, d), (B * s, hkv, d), "bfloat16", cu, cu, s, s, causal=causal)
    kb = cubeattn._core.cuda_bench_forward_backward if bwd else cubeattn._core.cuda_bench_forward
    res = {}
    ts = sorted(kb(spec, 3, 30)); res["kernel_row"] = ts[len(ts) // 2]
    for impl, fn in (("cubeattn", ours), ("sdpa_cudnn", cudnn)):
        res[impl + "_ms"] = median_ms(fn, 3, 30, sync)[0]
        # profile 8 synced steps
        for _ in range(3): fn(); sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(8):
                with record_function("STEP"):
                    fn(); sync()
        path = f"{OUT}/trace_{name}_{impl}.json"
        prof.export_chrome_trace(path)
        ev = json.load(open(path))["traceEvents"]
        steps = sorted([(e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("name") == "STEP" and e.get("ph") == "X" and e.get("cat") == "user_annotation"])
        gpu = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")]
        per = []
        kern = {}
        for a, b in steps:
            g = sorted([(e["ts"], e["ts"] + e["dur"], e["name"]) for e in gpu if a <= e["ts"] <= b])
            if not g: continue
            busy = sum(y - x for x, y, _ in g)
            per.append(dict(step=b - a, to_first=g[0][0] - a, busy=busy, span=g[-1][1] - g[0][0], tail=b - g[-1][1], n=len(g)))
            for x, y, nm in g:
                kern.setdefault(nm[:70], []).append(y - x)
        med = {key: statistics.median(p[key] for p in per) for key in per[0]} if per else {}
        res[impl + "_prof"] = med
        res[impl + "_kernels"] = {nm: (len(v) / max(len(per), 1), statistics.mean(v)) for nm, v in kern.items()}
        os.remove(path)
    return res
cases = [
    ("fwd_d128_4k_nc", 1, 4096, 32, 8, 128, False, False),
    ("fwd_d128_4k_c", 1, 4096, 32, 8, 128, True, False),
    ("fwd_d64_4k_c", 1, 4096, 32, 8, 64, True, False),
    ("fwd_d128_16k_nc", 1, 16384, 32, 8, 128, False, False),
    ("fb_d128_4k_c", 1, 4096, 32, 8, 128, True, True),
    ("fb_d128_8k_c", 1, 8192, 32, 8, 128, True, True),
    ("fb_d128_8k_nc", 1, 8192, 32, 8, 128, False, True),
    ("fb_d64_16k_nc", 1, 16384, 32, 8, 64, False, True),
]
only = sys.argv[1:]
allres = {}
for c in cases:
    if only and c[0] not in only: continue
    r = case(*c)
    allres[c[0]] = r
    print(f"== {c[0]}: kernel_row {r['kernel_row']:.3f}  ours {r['cubeattn_ms']:.3f}  cudnn {r['sdpa_cudnn_ms']:.3f} ms")
    for impl in ("cubeattn", "sdpa_cudnn"):
        p = r[impl + "_prof"]
        print(f"   {impl:10s} step {p['step']/1e3:.3f} to_first {p['to_first']:.0f}us busy {p['busy']/1e3:.3f} span {p['span']/1e3:.3f} tail {p['tail']:.0f}us n {p['n']}")
        for nm, (cnt, us) in sorted(r[impl + "_kernels"].items(), key=lambda x: -x[1][0] * x[1][1]):
            print(f"      {cnt:4.1f}x {us:9.1f}us  {nm}")
    sys.stdout.flush()
json.dump(allres, open(f"{OUT}/prof_path.json", "w"), indent=1)
