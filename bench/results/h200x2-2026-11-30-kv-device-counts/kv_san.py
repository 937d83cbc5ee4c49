"""Device-count decode steps for compute-sanitizer: ragged counts, a bad count, d64 / d128, capacity
off the tiles; each checked against the host-count path (exit 1 on a mismatch)."""
import sys, torch, cubeattn
ok = True
for d, cap in ((128, 1000), (64, 333)):
    g = torch.Generator(device="cuda").manual_seed(d)
    b = 4
    q = torch.randn(b, 1, 16, d, device="cuda", dtype=torch.bfloat16, generator=g)
    kc = torch.randn(b, cap, 4, d, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(b, cap, 4, d, device="cuda", dtype=torch.bfloat16, generator=g)
    kn = torch.randn(b, 1, 4, d, device="cuda", dtype=torch.bfloat16, generator=g)
    vn = torch.randn(b, 1, 4, d, device="cuda", dtype=torch.bfloat16, generator=g)
    lens = [cap - 1, 0, 64, 130]
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for causal in (False, True):
        want = cubeattn.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), kn, vn, cache_seqlens=sl, causal=causal)  # validating path
        got = cubeattn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=sl, causal=causal)  # device counts
        e = ((got.float() - want.float()).norm() / want.float().norm()).item()
        print(f"d{d} cap{cap} causal={causal} rel {e:.2e}", flush=True)
        ok &= e < 2e-3
    bad = torch.tensor([5, -3, cap, 7], dtype=torch.int32, device="cuda")
    out = cubeattn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=bad)
    nan_rows = [bool(torch.isnan(out[r]).all()) for r in range(b)]
    print(f"d{d} bad counts -> NaN rows {nan_rows}", flush=True)
    ok &= nan_rows == [False, True, True, False]
sys.exit(0 if ok else 1)
