"""torch.autograd glue for block-sparse attention (the sibling of `_autograd.py` for dense
attention): when q, k or v is a torch tensor that requires grad, the output joins the autograd
graph and its backward runs cubeattn's block-sparse backward (same spec, same device choice:
on torch CUDA tensors the CUDA kernels, enqueued on the current stream with no host copies).
No maths here."""
from __future__ import annotations

import torch


class _BlockSparseAttention(torch.autograd.Function):
    """out, lse = block_sparse_attention(q, k, v) for one validated sparse spec (varlen layout);
    lse is not differentiable. `conv`: q, k, v already converted for the core."""

    @staticmethod
    def forward(ctx, q, k, v, spec, conv, device, deterministic):
        from ._sparse import _run_forward

        out, lse = _run_forward(spec, *conv, device)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.device, ctx.deterministic = spec, device, deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        from ._sparse import _run_backward

        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _run_backward(ctx.spec, dout.contiguous(), q, k, v, out, lse, ctx.device, ctx.deterministic)
        return dq, dk, dv, None, None, None, None


def needs_grad(*xs) -> bool:
    """True when grad mode is on and one of `xs` is a torch tensor that requires grad."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in xs)


def attention(spec, q, k, v, conv, device, deterministic):
    """The differentiable forward (varlen layout); q, k, v must all be torch tensors."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"invalid argument `{name}`: with torch inputs that require grad, q, k and v must "
                            f"all be torch tensors, got {type(x).__name__}")
    return _BlockSparseAttention.apply(q, k, v, spec, conv, device, deterministic)
