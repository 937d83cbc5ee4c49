"""A small deterministic d128 backward (the fixed-point dQ) for compute-sanitizer: bf16, GQA 8/2,
one 700-token sequence, non-causal then causal; prints dq's relative L2 error against an f32
torch reference."""
import torch, cubeattn
torch.manual_seed(0)
for causal in (False, True):
    q = torch.randn(1, 700, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 700, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 700, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(1, 700, 8, 128, device="cuda", dtype=torch.bfloat16)
    cubeattn.flash_attn_func(q, k, v, causal=causal, deterministic=True).backward(g)
    qf, kf, vf = (x.detach().float().transpose(1, 2).requires_grad_(True) for x in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=causal, enable_gqa=True)
    o.backward(g.float().transpose(1, 2))
    ref = qf.grad.transpose(1, 2)
    print(f"causal={causal} dq rel_l2 {((q.grad.float() - ref).norm() / ref.norm()).item():.2e}")
