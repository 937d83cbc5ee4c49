"""Is the forward kernel slower when run alone? B4 H32 MHA d128 bf16 causal 8K, ours vs cuDNN: the main kernel's
duration (torch.profiler) in three modes: back-to-back calls; each call synced and followed by 1 ms idle;
each call after a 256 MB L2-flush memset (as triton do_bench). Also CUDA-event times of the whole call in each mode."""
import os, time, statistics, torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import profile, ProfilerActivity
import cubeattn
B, H, S, d = 4, 32, int(os.environ.get("S", "8192")), 128
causal = os.environ.get("CAUSAL", "1") == "1"
g = torch.Generator(device="cuda").manual_seed(1)
q, k, v = (torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
q4, k4, v4 = (x.transpose(1, 2) for x in (q, k, v))
flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
def ours():
    return cubeattn.flash_attn_func(q, k, v, causal=causal)
def cudnn():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal)
for name, f in (("cubeattn", ours), ("sdpa_cudnn", cudnn)):
    with torch.no_grad():
        for _ in range(10): f()
        torch.cuda.synchronize()
        for mode in ("back2back", "synced_idle", "l2flush"):
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(20)]
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for i in range(20):
                    if mode == "l2flush":
                        flush.zero_()
                    ev[i][0].record(); f(); ev[i][1].record()
                    if mode == "synced_idle":
                        torch.cuda.synchronize(); time.sleep(0.001)
                torch.cuda.synchronize()
            evt = statistics.median(a.elapsed_time(b) for a, b in ev)
            ks = {}
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    ks.setdefault(e.name[:40], []).append(e.device_time_total / 1000.0)
            main = max(ks.items(), key=lambda x: sum(x[1]))
            print(f"{name:10s} {mode:12s} causal={causal}: call (events) median {evt:.3f} ms; main kernel {main[0]} median {statistics.median(main[1]):.3f} ms min {min(main[1]):.3f} max {max(main[1]):.3f}")
