"""One process of the CUBEATTN_CUDA_SAGE_FRAME A/B (run1.sh alternates the settings: 0 =
`flash_fwd_sm90`'s FP8 variant, 1 = `flash_fwd_sage` at three cubes per SM, 2 = at two): B4 H32
d128 bf16 randn, 8K / 16K, causal and not. `cubeattn.sageattn` INT8 + FP8 P.V ("fp8", per_warp),
our bf16 forward ("bf16") and SDPA cuDNN ("cudnn") timed in turns (`cubeattn.bench.interleaved_ms`,
one sync per call); fp8's and bf16's accuracy against the f64 attention of the same inputs (batch
0, 4 heads: `cubeattn.bench._attention_f64`). One JSON line a row. Usage: ab_sage.py TAG [ITERATIONS]"""
import json, os, sys
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import cubeattn
from cubeattn.bench import _acc, _attention_f64, _ref_heads, interleaved_ms

tag = sys.argv[1]
iters = int(sys.argv[2]) if len(sys.argv) > 2 else 12
B, H, D = 4, 32, 128
sync = torch.cuda.synchronize
heads = _ref_heads(H)
frame = os.environ.get("CUBEATTN_CUDA_SAGE_FRAME", "1")
for s in (8192, 16384):
    g = torch.Generator(device="cuda").manual_seed(s)
    q, k, v = (torch.randn(B, s, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    for causal in (False, True):
        key = dict(what="sage_fwd", B=B, H=H, S=s, D=D, causal=causal, tag=tag, frame=frame)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        fns = [("cubeattn_int8_fp8", lambda: cubeattn.sageattn(q, k, v, is_causal=causal, quant_gran="per_warp", pv_precision="fp8")),
               ("cubeattn_bf16", lambda: cubeattn.flash_attn_func(q, k, v, causal=causal)),
               ("sdpa_cudnn", cudnn)]
        for _, fn in fns:
            fn()  # kernels compiled (or read from the disk cache) before any timing
        ms = interleaved_ms(fns, 3, iters, sync)
        ref = _attention_f64(torch, q, k, v, heads, causal)
        for name, fn in fns:
            r = dict(key, impl=name, ms=ms[name][0], ms_min=ms[name][1], ms_max=ms[name][2],
                     tflops=4 * B * H * s * s * D / (2 if causal else 1) / ms[name][0] / 1e9)
            if name != "sdpa_cudnn":
                r.update(_acc(fn()[0, :, heads], ref))
            print(json.dumps(r), flush=True)
        del ref
    del q, k, v, qt, kt, vt
