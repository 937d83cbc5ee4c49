"""Where a sync-per-call FP8 `sageattn` call's wall time goes beyond its kernels' GPU time (B4 H32
d128 bf16 8K / 16K, non-causal, per_warp, pv_precision="fp8"), beside our bf16 forward and SDPA
cuDNN: per impl the host time of one call (launches only, no sync), the GPU time of back-to-back
calls (CUDA events over 10 calls, no sync between), the wall time of synced calls, and the same
three in turns with the peers (`interleaved_ms`). Then torch.profiler (CPU + CUDA) of 3 synced
FP8 calls. One JSON line a measurement."""
import json, statistics, sys, time
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import cubeattn
from cubeattn.bench import interleaved_ms

B, H, D = 4, 32, 128
sync = torch.cuda.synchronize
for s in (8192, 16384):
    q, k, v = (torch.randn(B, s, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt)
    fns = [("fp8", lambda: cubeattn.sageattn(q, k, v, quant_gran="per_warp", pv_precision="fp8")),
           ("int8", lambda: cubeattn.sageattn(q, k, v, quant_gran="per_warp")),
           ("bf16", lambda: cubeattn.flash_attn_func(q, k, v)),
           ("cudnn", cudnn)]
    for name, fn in fns:
        for _ in range(3):
            fn()
        sync()
        host, wall = [], []
        for _ in range(10):
            sync()
            t = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t) * 1e3)
            sync()
            wall.append((time.perf_counter() - t) * 1e3)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(10):
            fn()
        e1.record()
        sync()
        print(json.dumps(dict(S=s, impl=name, host_ms=statistics.median(host), wall_ms=statistics.median(wall),
                              gpu_b2b_ms=e0.elapsed_time(e1) / 10)), flush=True)
    ms = interleaved_ms(fns, 3, 12, sync)
    for name, m in ms.items():
        print(json.dumps(dict(S=s, impl=name, turns_ms=m[0], turns_min=m[1], turns_max=m[2])), flush=True)
    if s == 8192:
        from torch.profiler import profile, ProfilerActivity
        f = fns[0][1]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            for _ in range(3):
                f()
                sync()
        print(p.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=70))
        print(p.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))
    del q, k, v, qt, kt, vt
