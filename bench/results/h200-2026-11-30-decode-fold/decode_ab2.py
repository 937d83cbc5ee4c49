"""Decode steps (Sq=1, GQA 32/8, d128, bf16) through flash_attn_func beside SDPA flash / cuDNN in one process (do_bench median, ms)."""
import os, json, torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import cubeattn
tag = os.environ.get("TAGX", "x"); rows = []
D = int(os.environ.get("D", "128"))
for b, sk in ((8, 4096), (1, 32768), (32, 2048), (8, 16384), (64, 1024)):
    g = torch.Generator(device="cuda").manual_seed(sk)
    q = torch.randn(b, 1, 32, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, sk, 8, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, sk, 8, D, device="cuda", dtype=torch.bfloat16, generator=g)
    ours = triton.testing.do_bench(lambda: cubeattn.flash_attn_func(q, k, v), warmup=50, rep=300, return_mode="median")
    q4, k4, v4 = (x.transpose(1, 2) for x in (q, k, v))
    res = dict(cubeattn=ours)
    for name, be in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        def f():
            with sdpa_kernel(be):
                F.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True)
        try:
            res[name] = triton.testing.do_bench(f, warmup=50, rep=300, return_mode="median")
        except Exception as e:
            res[name] = float("nan")
    for impl, ms in res.items():
        rows.append(dict(what="decode_fwd", impl=impl, variant=tag, D=D, B=b, Sq=1, Sk=sk, ms=ms))
    print(f"{tag:8s} D{D} B{b:3d} Sk{sk:6d}: ours {res['cubeattn']*1e3:7.1f} us  flash {res['sdpa_flash']*1e3:7.1f}  cudnn {res['sdpa_cudnn']*1e3:7.1f}", flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), f"decode_{tag.replace(':','x')}_{os.getpid()}.json"), "w"), indent=1)
