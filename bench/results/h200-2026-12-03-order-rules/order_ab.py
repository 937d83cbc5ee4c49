"""Cube order A/B of the forward (kernel alone, CUDA events, `cuda_bench_forward`) on the shapes the
rules of `forward::kv_outer` were set without: small causal d128 launches (the 6-wave guard),
d64 causal by batch and length, and window calls; SDPA cuDNN's torch call beside the shapes it
runs (no window). The order is this process's CUBEATTN_FWD_ORDER. Writes {"env", "rows"} JSON to
argv[1]."""
import json, os, sys

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cubeattn
from cubeattn import bench

CASES = [  # (config, B, S, causal, window)
    ("llama3-8b", 1, 1024, True, None), ("llama3-8b", 1, 2048, True, None), ("llama3-8b", 1, 3072, True, None),
    ("llama3-8b", 2, 2048, True, None), ("llama3-8b", 4, 1024, True, None), ("llama3-8b", 2, 4096, True, None),
    ("gqa-d64", 1, 8192, True, None), ("gqa-d64", 1, 16384, True, None), ("gqa-d64", 1, 32768, True, None),
    ("gqa-d64", 4, 8192, True, None), ("gqa-d64", 2, 16384, True, None), ("gqa-d64", 4, 2048, True, None),
    ("llama3-8b", 1, 16384, True, (2048, 0)), ("llama3-8b", 1, 32768, True, (4096, 0)),
    ("llama3-8b", 1, 16384, False, (2048, 2048)), ("gqa-d64", 1, 32768, True, (4096, 0)),
]
order = os.environ.get("CUBEATTN_FWD_ORDER", "default")
rows = []
for cfg, B, S, causal, win in CASES:
    hq, hkv, d = bench.CONFIGS[cfg]
    cu = [i * S for i in range(B + 1)]
    spec = cubeattn.varlen_spec((B * S, hq, d), (B * S, hkv, d), "bfloat16", cu, cu, S, S, causal=causal,
                                window_size=win or (-1, -1))
    key = dict(what="dense_fwd", config=cfg, B=B, S=S, D=d, causal=causal, window=list(win) if win else None, order=order)
    ts = sorted(cubeattn._core.cuda_bench_forward(spec, 3, 30))
    rows.append(dict(key, impl="cubeattn_kernel", ms=ts[len(ts) // 2], ms_min=ts[0], ms_max=ts[-1]))
    if win is None:
        q = torch.randn(B, hq, S, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, hkv, S, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)

        def peer():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        ms = bench.median_ms(peer, 3, 30, torch.cuda.synchronize)
        rows.append(dict(key, impl="sdpa_cudnn", ms=ms[0], ms_min=ms[1], ms_max=ms[2]))
        del q, k, v
    print(cfg, B, S, causal, win, order, rows[-1 if win else -2]["ms"], flush=True)
json.dump({"env": bench.environment("cuda"), "rows": rows}, open(sys.argv[1], "w"), indent=1)
