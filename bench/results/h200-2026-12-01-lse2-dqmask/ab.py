"""A/B of backward builds: kernel rows (cuda_bench_forward_backward) and the torch autograd step of
cubeattn for the shapes below; `--cudnn` adds SDPA cuDNN's torch step. Prints one JSON line a row."""
import json, os, sys, torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import cubeattn
from cubeattn.bench import median_ms
tag = sys.argv[1]
cudnn = "--cudnn" in sys.argv
shapes = [(128, True, 4096), (128, True, 8192), (128, True, 16384), (128, False, 4096), (128, False, 8192), (128, False, 16384),
          (64, True, 4096), (64, True, 8192), (64, True, 16384), (64, False, 8192), (64, False, 16384)]
sync = torch.cuda.synchronize
for d, causal, s in shapes:
    cu = [0, s]
    spec = cubeattn.varlen_spec((s, 32, d), (s, 8, d), "bfloat16", cu, cu, s, s, causal=causal)
    key = dict(D=d, causal=causal, S=s, tag=tag)
    ts = sorted(cubeattn._core.cuda_bench_forward_backward(spec, 3, 20))
    print(json.dumps(dict(key, impl="cubeattn_kernel", ms=ts[len(ts) // 2])), flush=True)
    q = torch.randn(1, s, 32, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, s, 8, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, s, 8, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    go = torch.randn(1, s, 32, d, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: cubeattn.flash_attn_func(q, k, v, causal=causal).backward(go), 3, 20, sync)[0]
    print(json.dumps(dict(key, impl="cubeattn", ms=ms)), flush=True)
    if "--det" in sys.argv:
        ms = median_ms(lambda: cubeattn.flash_attn_func(q, k, v, causal=causal, deterministic=True).backward(go), 3, 20, sync)[0]
        print(json.dumps(dict(key, impl="cubeattn_deterministic", ms=ms)), flush=True)
    if cudnn:
        q4, k4, v4 = (x.detach().transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k, v))
        go4 = go.transpose(1, 2).contiguous()
        def step():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal, enable_gqa=True)
            o.backward(go4)
        ms = median_ms(step, 3, 20, sync)[0]
        print(json.dumps(dict(key, tag="peer", impl="sdpa_cudnn", ms=ms)), flush=True)
