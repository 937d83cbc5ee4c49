"""deterministic=True fwd+bwd through torch autograd (`flash_attn_func(...).backward(g)`) beside the
default (fused dQ) and SDPA cuDNN, the three steps timed in turns (`bench.interleaved_ms`), causal
Llama3-8B (d128) and gqa-d64 heads, B = 1. The dQ pass's cube order is this process's
CUBEATTN_DQ_ORDER (the deterministic step's only change between the processes). Writes
{"env", "rows"} JSON to argv[1]."""
import json, os, sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cubeattn
from cubeattn import bench

order = os.environ.get("CUBEATTN_DQ_ORDER", "default")
rows = []
for cfg, seqs in (("llama3-8b", (4096, 8192, 16384, 32768)), ("gqa-d64", (8192, 16384))):
    hq, hkv, d = bench.CONFIGS[cfg]
    for s in seqs:
        q = torch.randn(1, s, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, s, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, s, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        go = torch.randn(1, s, hq, d, device="cuda", dtype=torch.bfloat16)
        q4, k4, v4 = (x.detach().transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k, v))
        go4 = go.transpose(1, 2).contiguous()

        def ours(det):
            return lambda: cubeattn.flash_attn_func(q, k, v, causal=True, deterministic=det).backward(go)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True).backward(go4)
        its = 20 if s <= 16384 else 8
        ms = bench.interleaved_ms([("cubeattn", ours(False)), ("cubeattn_deterministic", ours(True)),
                                   ("sdpa_cudnn", cudnn)], 3, its, torch.cuda.synchronize)
        for impl, m in ms.items():
            rows.append(dict(what="dense_fwdbwd", config=cfg, B=1, S=s, D=d, causal=True, dq_order=order, impl=impl,
                             ms=m[0], ms_min=m[1], ms_max=m[2]))
        print(cfg, s, order, {i: round(m[0], 3) for i, m in ms.items()}, flush=True)
        del q, k, v, go, q4, k4, v4, go4
json.dump({"env": bench.environment("cuda"), "rows": rows}, open(sys.argv[1], "w"), indent=1)
