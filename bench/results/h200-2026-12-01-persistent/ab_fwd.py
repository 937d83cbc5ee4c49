"""A/B of forward launches (run once per build or switch setting): the forward kernel row
(cuda_bench_forward, CUDA events) and the torch path (flash_attn_func) of cubeattn for the shapes
below; `--cudnn` adds SDPA cuDNN's forward. Prints one JSON line a row."""
import json, sys, torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import cubeattn
from cubeattn.bench import median_ms
tag = sys.argv[1]
cudnn = "--cudnn" in sys.argv
# (B, S, hq, hkv, d, causal)
shapes = [(1, 4096, 32, 8, 128, False), (1, 8192, 32, 8, 128, False), (1, 16384, 32, 8, 128, False), (4, 4096, 32, 32, 128, False),
          (1, 8192, 16, 8, 256, False), (1, 8192, 32, 8, 128, True)]
sync = torch.cuda.synchronize
for b, s, hq, hkv, d, causal in shapes:
    cu = [i * s for i in range(b + 1)]
    spec = cubeattn.varlen_spec((b * s, hq, d), (b * s, hkv, d), "bfloat16", cu, cu, s, s, causal=causal)
    key = dict(B=b, S=s, hq=hq, hkv=hkv, D=d, causal=causal, tag=tag)
    ts = sorted(cubeattn._core.cuda_bench_forward(spec, 5, 30))
    print(json.dumps(dict(key, what="dense_fwd", impl="cubeattn_kernel", ms=ts[len(ts) // 2])), flush=True)
    q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: cubeattn.flash_attn_func(q, k, v, causal=causal), 5, 30, sync)[0]
    print(json.dumps(dict(key, what="dense_fwd", impl="cubeattn", ms=ms)), flush=True)
    if cudnn:
        q4, k4, v4 = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        def step():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal, enable_gqa=True)
        ms = median_ms(step, 5, 30, sync)[0]
        print(json.dumps(dict(key, what="dense_fwd", tag="peer", impl="sdpa_cudnn", ms=ms)), flush=True)
