"""One zigzag rank's grouped forward (bench.py's _zigzag_rank: Llama3-8B heads, bf16, bottom-right
causal, two query chunks), our launch alone (`cubeattn_kernel`, CUDA events) beside cuDNN split +
merge (`cudnn_split_merge`), in the cube order of this process (CUBEATTN_FWD_ORDER). Writes
{"env", "rows"} JSON to argv[1]."""
import json, os, sys

import torch

import cubeattn
from cubeattn import _lse_split, bench

hq, hkv, d = bench.CONFIGS["llama3-8b"]
op = _lse_split.CudnnOp()
rows = []
for T, W in ((16384, 2), (32768, 4), (65536, 4), (65536, 8)):
    for r in (0, W - 1):
        zz = bench._zigzag_rank(T, W, r, hq, hkv, d, "bfloat16", grad=False)
        key = dict(what="zigzag_fwd", config="llama3-8b", T=T, W=W, rank=r, order=os.environ.get("CUBEATTN_FWD_ORDER", "default"))
        ts = sorted(cubeattn._core.cuda_bench_forward(zz.spec, 3, 20))
        rows.append(dict(key, impl="cubeattn_kernel", ms=ts[len(ts) // 2], tflops=zz.flops / ts[len(ts) // 2] / 1e9))
        qs = [torch.randn(1, hq, zz.C, d, device="cuda", dtype=torch.bfloat16) for _ in zz.ends]
        k = torch.randn(1, hkv, T, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        ms = bench.median_ms(lambda: [_lse_split.lower_right_causal(q, k[:, :, :e], v[:, :, :e], op) for q, e in zip(qs, zz.ends)],
                             3, 20, torch.cuda.synchronize)[0]
        rows.append(dict(key, impl="cudnn_split_merge", ms=ms, tflops=zz.flops / ms / 1e9))
        print(T, W, r, rows[-2]["ms"], ms, flush=True)
        del qs, k, v
json.dump({"env": bench.environment("cuda"), "rows": rows}, open(sys.argv[1], "w"), indent=1)
