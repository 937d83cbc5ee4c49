"""d32 on Hopper: its own mma.sync kernels vs the d64 wgmma kernels with zero columns (the
zero-column copies done in torch here, as head_pad would do them), beside SDPA cuDNN / flash;
forward and fwd+bwd, bf16, 32 / 8 heads, causal and not, torch path, timed in turns."""
import json, sys
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import cubeattn
from cubeattn.bench import interleaved_ms

rows = []
hq, hkv, d = 32, 8, 32
for s in (8192, 16384):
    for causal in (True, False):
        q = torch.randn(1, s, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, s, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, s, hkv, d, device="cuda", dtype=torch.bfloat16)
        go = torch.randn_like(q)
        sc = d ** -0.5
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def native(grad):
            def f():
                qq, kk, vv = (x.detach().requires_grad_(grad) for x in (q, k, v))
                o = cubeattn.flash_attn_func(qq, kk, vv, causal=causal)
                if grad:
                    o.backward(go)
            return f

        def padded(grad):
            def f():
                qq, kk, vv = (x.detach().requires_grad_(grad) for x in (q, k, v))
                pq, pk, pv = (F.pad(x, (0, 64 - d)) for x in (qq, kk, vv))
                o = cubeattn.flash_attn_func(pq, pk, pv, causal=causal, softmax_scale=sc)[..., :d]
                if grad:
                    o.backward(go)
            return f

        def sdpa(be, grad):
            def f():
                qq, kk, vv = (x.detach().requires_grad_(grad) for x in (qt, kt, vt))
                with sdpa_kernel(be):
                    o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, enable_gqa=True)
                if grad:
                    o.backward(go.transpose(1, 2))
            return f

        for grad in (False, True):
            # the padded result equals the native one
            with torch.no_grad():
                a = cubeattn.flash_attn_func(q, k, v, causal=causal)
                b = cubeattn.flash_attn_func(*(F.pad(x, (0, 64 - d)) for x in (q, k, v)), causal=causal,
                                             softmax_scale=sc)[..., :d]
            err = ((a.float() - b.float()).abs().max() / a.float().abs().max()).item()
            fns = [("cubeattn_d32", native(grad)), ("cubeattn_d32_padded_64", padded(grad)),
                   ("sdpa_cudnn", sdpa(SDPBackend.CUDNN_ATTENTION, grad)),
                   ("sdpa_flash", sdpa(SDPBackend.FLASH_ATTENTION, grad))]
            for impl, ms in interleaved_ms(fns, 3, 20, torch.cuda.synchronize).items():
                r = dict(what="dense_fwdbwd" if grad else "dense_fwd", impl=impl, S=s, D=d, causal=causal, ms=ms[0],
                         padded_vs_native_max_rel=err)
                rows.append(r)
                print(r["what"], impl, s, causal, round(ms[0], 3), flush=True)
env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, commit=sys.argv[2] if len(sys.argv) > 2 else "")
json.dump(dict(env=env, rows=rows), open(sys.argv[1], "w"), indent=1)
