"""A/B of `flash_fwd_ws`'s epilogue (this process's CUBEATTN_FWD_OUT: `direct` = 4-byte pair stores
from the accumulators and the non-finite flag tested first; unset = O through shared memory in
16-byte row chunks, the flag tested after the prologue's loads): our kernel alone
(`cuda_bench_forward`, CUDA events) and the torch calls of ours and SDPA cuDNN timed in turns
(`interleaved_ms`). Writes {"env", "rows"} JSON to argv[1]."""
import json, os, sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cubeattn
from cubeattn import bench

CASES = [  # (config, B, S, causal)
    ("llama3-8b", 1, 4096, False), ("llama3-8b", 1, 8192, False), ("llama3-8b", 1, 16384, False),
    ("llama3-8b", 1, 32768, False), ("llama3-8b", 1, 4096, True), ("llama3-8b", 1, 8192, True),
    ("llama3-8b", 1, 16384, True), ("gqa-d256", 1, 8192, False), ("mla-d192-v128", 1, 8192, True),
]
variant = os.environ.get("CUBEATTN_FWD_OUT", "staged")
rows = []
sync = torch.cuda.synchronize
for cfg, B, S, causal in CASES:
    hq, hkv, d = bench.CONFIGS[cfg]
    dv = bench.V_HEAD_DIMS.get(cfg, d)
    cu = [i * S for i in range(B + 1)]
    spec = cubeattn.varlen_spec((B * S, hq, d), (B * S, hkv, d), "bfloat16", cu, cu, S, S, causal=causal,
                                v_shape=(B * S, hkv, dv))
    key = dict(what="dense_fwd", config=cfg, B=B, S=S, D=d, Dv=dv, causal=causal, variant=variant)
    ts = sorted(cubeattn._core.cuda_bench_forward(spec, 3, 30))
    rows.append(dict(key, impl="cubeattn_kernel", ms=ts[len(ts) // 2], ms_min=ts[0], ms_max=ts[-1]))
    q = torch.randn(B, S, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, S, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, S, hkv, dv, device="cuda", dtype=torch.bfloat16)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def peer():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True)
    steps = [("cubeattn", lambda: cubeattn.flash_attn_func(q, k, v, causal=causal)), ("sdpa_cudnn", peer)]
    res = bench.interleaved_ms(steps, 3, 20, sync)
    for impl, ms in res.items():
        rows.append(dict(key, impl=impl, ms=ms[0], ms_min=ms[1], ms_max=ms[2]))
    print(cfg, B, S, causal, variant, " ".join(f"{r['impl']} {r['ms']:.3f}" for r in rows[-3:]), flush=True)
    del q, k, v, qt, kt, vt
json.dump({"env": bench.environment("cuda"), "rows": rows}, open(sys.argv[1], "w"), indent=1)
