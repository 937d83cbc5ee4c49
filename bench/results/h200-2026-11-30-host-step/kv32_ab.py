"""Re-measure: flash_attn_with_kvcache int cache_seqlens, 32 x 2K keys, capacity 2K / 4K, one token appended (do_bench us)."""
import os, torch, triton, cubeattn
b, sk = 32, 2048
for cap in (2048, 4096):
    g = torch.Generator(device="cuda").manual_seed(sk)
    q = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    kc = torch.randn(b, cap, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(b, cap, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    kn = torch.randn(b, 1, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    vn = torch.randn(b, 1, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    sl = torch.full((b,), sk - 1, dtype=torch.int32, device="cuda")
    a = triton.testing.do_bench(lambda: cubeattn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=sk - 1), warmup=50, rep=300, return_mode="median")
    d = triton.testing.do_bench(lambda: cubeattn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=sl), warmup=50, rep=300, return_mode="median")
    print(f"DECODE={os.environ.get('CUBEATTN_CUDA_DECODE','1')} B32 Sk2048 cap{cap}: int {a*1e3:.1f} us  cuda_seqlens {d*1e3:.1f} us", flush=True)
