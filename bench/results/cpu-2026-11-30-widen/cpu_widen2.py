import os, time, torch, cubeattn
torch.set_num_threads(2)
def best(f, t=0.5):
    for _ in range(2): f()
    b = 1e9
    for _ in range(3):
        t0 = time.perf_counter(); n = 0
        while time.perf_counter() - t0 < t:
            f(); n += 1
        b = min(b, (time.perf_counter() - t0) / n * 1e3)
    return b
sdpa = torch.nn.functional.scaled_dot_product_attention
for dt in (torch.float16, torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 32, 128, generator=g).to(dt); k = torch.randn(1, 32768, 1, 128, generator=g).to(dt); v = torch.randn_like(k)
    q4, k4, v4 = (x.transpose(1, 2) for x in (q, k, v))
    a = best(lambda: cubeattn.flash_attn_func(q, k, v, device='cpu')); b = best(lambda: sdpa(q4, k4, v4, enable_gqa=True)) if os.environ.get("PEER") else float("nan")
    print(f"{os.environ.get('TAG')} decode 1x32K hkv1 {str(dt)[6:]:8s}: ours {a:7.2f} ms torch {b:7.2f}", flush=True)
    q = torch.randn(1, 2048, 32, 128, generator=g).to(dt); k = torch.randn(1, 2048, 8, 128, generator=g).to(dt); v = torch.randn_like(k)
    q4, k4, v4 = (x.transpose(1, 2) for x in (q, k, v))
    a = best(lambda: cubeattn.flash_attn_func(q, k, v, causal=True, device='cpu'), 1.0); b = best(lambda: sdpa(q4, k4, v4, is_causal=True, enable_gqa=True), 1.0) if os.environ.get("PEER") else float("nan")
    print(f"{os.environ.get('TAG')} prefill 2K causal 32/8 {str(dt)[6:]:8s}: ours {a:7.2f} ms torch {b:7.2f}", flush=True)
