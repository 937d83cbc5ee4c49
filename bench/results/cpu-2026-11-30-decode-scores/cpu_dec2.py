import os, time, torch, cubeattn
torch.set_num_threads(2)
for hkv, B, sk in ((1, 1, 32768), (2, 1, 16384), (8, 8, 4096)):
    for dt in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(B, 1, 32, 128, generator=g).to(dt)
        k = torch.randn(B, sk, hkv, 128, generator=g).to(dt)
        v = torch.randn(B, sk, hkv, 128, generator=g).to(dt)
        f = lambda: cubeattn.flash_attn_func(q, k, v, device="cpu")
        for _ in range(3): f()
        best = 1e9
        for _ in range(3):
            t0 = time.perf_counter(); n = 0
            while time.perf_counter() - t0 < 0.5:
                f(); n += 1
            best = min(best, (time.perf_counter() - t0) / n * 1e3)
        print(f"{os.environ.get('TAG', 'x')} hkv {hkv} B {B} Sk {sk} {str(dt)[6:]:8s}: ours {best:7.2f} ms", flush=True)
