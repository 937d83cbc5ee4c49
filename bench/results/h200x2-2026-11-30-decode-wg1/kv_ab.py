"""Decode steps through flash_attn_with_kvcache (one new token appended, GQA 32/8, d128, bf16):
cache_seqlens as an int, as an int32 CUDA tensor (the device-count path), the tensor path inside a
CUDA graph (replayed), beside flash_attn_func over the same keys and SDPA flash / cuDNN. Capacity
= the keys used (cap1) or twice (cap2). do_bench medians (ms)."""
import os, json, torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import cubeattn
rows = []
def bench(f):
    return triton.testing.do_bench(f, warmup=50, rep=300, return_mode="median")
for b, sk in ((8, 4096), (1, 32768), (32, 2048), (8, 16384), (64, 1024)):
    for capx in (1, 2):
        cap = sk * capx
        g = torch.Generator(device="cuda").manual_seed(sk)
        q = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        kc = torch.randn(b, cap, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        vc = torch.randn(b, cap, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        kn = torch.randn(b, 1, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        vn = torch.randn(b, 1, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        n = sk - 1
        sl = torch.full((b,), n, dtype=torch.int32, device="cuda")
        res = {}
        res["kvcache_int"] = bench(lambda: cubeattn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=n))
        res["kvcache_cuda_seqlens"] = bench(lambda: cubeattn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=sl))
        o_int = cubeattn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=n)
        o_dev = cubeattn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=sl)
        diff = ((o_int.float() - o_dev.float()).norm() / o_int.float().norm()).item()
        try:
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                cubeattn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=sl)
            res["kvcache_cuda_seqlens_graph"] = bench(gr.replay)
        except Exception as e:
            print("graph failed:", repr(e)[:300]); res["kvcache_cuda_seqlens_graph"] = float("nan")
        if capx == 1:
            res["flash_attn_func"] = bench(lambda: cubeattn.flash_attn_func(q, kc, vc))
            q4, k4, v4 = (x.transpose(1, 2) for x in (q, kc, vc))
            for name, be in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                def f():
                    with sdpa_kernel(be):
                        F.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True)
                res[name] = bench(f)
        for impl, ms in res.items():
            rows.append(dict(what="decode_fwd", impl=impl, variant=os.environ.get("TAGX", "x"), B=b, Sq=1, Sk=sk, capacity=cap, ms=ms))
        print(f"B{b:3d} Sk{sk:6d} cap{cap:6d}: " + "  ".join(f"{k} {v*1e3:6.1f}" for k, v in res.items()) + f"  rel(int,dev) {diff:.1e}", flush=True)
        del q, kc, vc
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), f"kv_{os.getpid()}.json"), "w"), indent=1)
