"""One process of the quantisation A/B (run1.sh alternates the two builds): B4 H32 d128 bf16 randn,
8K and 16K. With `--profile`: torch.profiler over 5 calls each of `sageattn` INT8 + FP8 P.V
("fp8") and INT8 alone ("int8", per_warp, non-causal): every kernel's time per launch, and
`int8_quantize`'s Q and K launches apart (in issue order: Q, then K, per call). Then both calls
timed in turns (`cubeattn.bench.interleaved_ms`, one sync per call), causal and not. One JSON line
a row. Usage: prof_quant.py TAG [--profile] [ITERATIONS]"""
import json, sys
import torch
import cubeattn
from cubeattn.bench import interleaved_ms

tag = sys.argv[1]
prof = "--profile" in sys.argv[2:]
rest = [a for a in sys.argv[2:] if a != "--profile"]
iters = int(rest[0]) if rest else 12
B, H, D = 4, 32, 128
sync = torch.cuda.synchronize


def kernel_rows(p, key):
    from torch.autograd import DeviceType
    rows = []
    for e in p.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = e.cuda_time_total
        if t > 0 and e.count > 0:
            rows.append(dict(key, kernel=e.key, launches=e.count, us_per_launch=t / e.count))
    q = [ev.time_range.elapsed_us() for ev in p.events()
         if "int8_quantize" in ev.name and getattr(ev, "device_type", DeviceType.CUDA) == DeviceType.CUDA]
    if q:
        rows.append(dict(key, kernel="int8_quantize Q", launches=len(q[0::2]), us_per_launch=sum(q[0::2]) / len(q[0::2])))
        if q[1::2]:
            rows.append(dict(key, kernel="int8_quantize K", launches=len(q[1::2]), us_per_launch=sum(q[1::2]) / len(q[1::2])))
    return rows


for s in (8192, 16384):
    g = torch.Generator(device="cuda").manual_seed(s)
    q, k, v = (torch.randn(B, s, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    for causal in (False, True):
        key = dict(what="quant_once_ab", B=B, H=H, S=s, D=D, causal=causal, tag=tag)
        fns = [("fp8", lambda: cubeattn.sageattn(q, k, v, is_causal=causal, quant_gran="per_warp", pv_precision="fp8")),
               ("int8", lambda: cubeattn.sageattn(q, k, v, is_causal=causal, quant_gran="per_warp"))]
        for _, fn in fns:
            fn()  # kernels compiled (or read from the disk cache) before any timing
        if prof and not causal:
            from torch.profiler import profile, ProfilerActivity
            for name, fn in fns:
                for _ in range(2):
                    fn()
                sync()
                with profile(activities=[ProfilerActivity.CUDA]) as p:
                    for _ in range(5):
                        fn()
                    sync()
                for r in kernel_rows(p, dict(key, impl=name, profile=True)):
                    print(json.dumps(r), flush=True)
        ms = interleaved_ms(fns, 3, iters, sync)
        for name, _ in fns:
            print(json.dumps(dict(key, impl=name, ms=ms[name][0], ms_min=ms[name][1], ms_max=ms[name][2])), flush=True)
    del q, k, v
