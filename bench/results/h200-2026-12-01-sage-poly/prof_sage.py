"""Where an FP8 `sageattn` call's GPU time goes: torch.profiler over 5 calls (B4 H32 d128 bf16,
8K / 16K, causal and not, per_warp, pv_precision="fp8"), the kernels by total CUDA time."""
import torch, cubeattn
from torch.profiler import profile, ProfilerActivity
B, H, D = 4, 32, 128
for s in (8192, 16384):
    q, k, v = (torch.randn(B, s, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for causal in (False, True):
        def f():
            return cubeattn.sageattn(q, k, v, is_causal=causal, quant_gran="per_warp", pv_precision="fp8")
        for _ in range(3):
            f()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(5):
                f()
            torch.cuda.synchronize()
        print(f"== S={s} causal={causal} (5 calls)")
        print(p.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    del q, k, v
