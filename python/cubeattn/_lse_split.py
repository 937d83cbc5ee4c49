"""Bottom-right causal attention of a query chunk over a longer key prefix (Sq <= Sk) from an
attention op that has only a top-left causal mask: the all-gather + cuDNN baseline of
``python -m cubeattn.bench zigzag`` (``impl: allgather_cudnn``).

SDPA's cuDNN backend has no bottom-right causal mask for Sq != Sk. A context-parallel layer built
on it splits each query chunk's keys into the causal square (the last Sq keys, where top-left and
bottom-right agree) and the non-causal prefix before it, runs the op on each, and merges the two
partial outputs by their log-sum-exp (torch's cuDNN attention op returns it). The backward runs the
op's backward on each part with the MERGED output and log-sum-exp: the probabilities exp(s - lse)
and the row terms rowsum(dO * O) are then the whole row's, so each part gives its exact share of dq
(the shares add up) and the exact dk, dv of its keys.

Ops (``forward(q, k, v, causal, scale) -> (out, lse [B, H, Sq] float32, aux)`` and
``backward(dout, q, k, v, out, lse, causal, scale, aux) -> (dq, dk, dv)``, tensors [B, H, S, D]):
``CudnnOp`` (torch's ``_scaled_dot_product_cudnn_attention`` and its backward; CUDA) and
``CpuFlashOp`` (torch's CPU flash-attention op and its backward, the same contract: the split, the
merge and the backward are tested on the CPU with it). K, V with fewer heads than q (GQA) are
passed as they are where the op takes them, else repeated per query head (and their gradients
summed back). Imported by the benchmark and the tests only (it imports torch).
"""
from __future__ import annotations

import torch


def lse_merge(o1, l1, o2, l2):
    """(out, lse) of attention over the union of two disjoint key sets, from each set's out
    [B, H, S, D] and lse [B, H, S] (natural log): computed in float32 (float64 for float64
    inputs), out in o1's dtype and layout."""
    dt = torch.promote_types(torch.promote_types(o1.dtype, l1.dtype), torch.float32)
    l1, l2 = l1.to(dt), l2.to(dt)
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    s = w1 + w2
    out = torch.empty_like(o1)
    out.copy_(o1.to(dt) * (w1 / s).unsqueeze(-1) + o2.to(dt) * (w2 / s).unsqueeze(-1))
    return out, m + torch.log(s)


def _repeat_heads(x, n):
    return x if x.shape[1] == n else x.repeat_interleave(n // x.shape[1], 1)


def _sum_heads(dx, n):
    """The gradient of `_repeat_heads` to n heads."""
    if dx.shape[1] == n:
        return dx
    b, h, s, d = dx.shape
    return dx.view(b, n, h // n, s, d).sum(2)


class CpuFlashOp:
    """torch's CPU flash-attention op (CPU tensors; K, V heads repeated for GQA)."""

    def forward(self, q, k, v, causal, scale):
        h = k.shape[1]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1]), 0.0, causal, scale=scale)
        return out, lse.float(), h

    def backward(self, dout, q, k, v, out, lse, causal, scale, h):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q, _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1]), out, lse, 0.0, causal,
            scale=scale)
        return dq, _sum_heads(dk, h), _sum_heads(dv, h)


class CudnnOp:
    """torch's cuDNN attention op (CUDA tensors). GQA K, V are passed as they are; if the op refuses
    them once, they are repeated per query head from then on."""

    def __init__(self):
        self.repeat = False
        self.fwd_op = torch.ops.aten._scaled_dot_product_cudnn_attention
        self.bwd_op = torch.ops.aten._scaled_dot_product_cudnn_attention_backward

    def forward(self, q, k, v, causal, scale):
        h = k.shape[1]
        call = self.fwd_op
        if h != q.shape[1] and not self.repeat:
            try:
                r = call(q, k, v, None, True, 0.0, causal, False, scale=scale)
            except RuntimeError:
                self.repeat = True
        if h == q.shape[1] or self.repeat:
            r = call(q, _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1]), None, True, 0.0, causal, False,
                     scale=scale)
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset = r[:8]
        b, hq, sq = q.shape[:3]
        # aux: what the backward op takes from the forward, and the layout lse came in
        layout = (tuple(lse.shape), lse.stride(), lse.dtype)
        return out, lse.reshape(b, hq, sq).float(), (h, layout, cum_q, cum_k, max_q, max_k, seed, offset)

    def backward(self, dout, q, k, v, out, lse, causal, scale, aux):
        h, (shape, stride, dtype), cum_q, cum_k, max_q, max_k, seed, offset = aux
        # dout in out's layout, the (merged) lse in the layout the forward gave it
        dout = torch.empty_like(out).copy_(dout)
        lse = torch.empty_strided(shape, stride, dtype=dtype, device=out.device).copy_(lse.reshape(shape))

        def call(kk, vv):
            return self.bwd_op(dout, q, kk, vv, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal,
                               scale=scale)
        if h != q.shape[1] and not self.repeat:
            try:
                return call(k, v)
            except RuntimeError:
                self.repeat = True
        dq, dk, dv = call(_repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1]))
        return dq, _sum_heads(dk, h), _sum_heads(dv, h)


class _LowerRightCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, op, scale):
        c, e = q.shape[2], k.shape[2]
        # (first key, end, causal): the causal square, then the non-causal prefix before it
        parts = [(e - c, e, True)] + ([(0, e - c, False)] if e > c else [])
        res = [op.forward(q, k[:, :, a:b], v[:, :, a:b], causal, scale) for a, b, causal in parts]
        out, lse = res[0][:2]
        if len(res) == 2:
            out, lse = lse_merge(out, lse, *res[1][:2])
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.parts, ctx.aux, ctx.op, ctx.scale = parts, [r[2] for r in res], op, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq = None
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        for (a, b, causal), aux in zip(ctx.parts, ctx.aux):
            gq, gk, gv = ctx.op.backward(dout, q, k[:, :, a:b], v[:, :, a:b], out, lse, causal, ctx.scale, aux)
            dq = gq if dq is None else dq + gq
            dk[:, :, a:b] = gk
            dv[:, :, a:b] = gv
        return dq, dk, dv, None, None


def lower_right_causal(q, k, v, op, scale=None):
    """Causal attention of q [B, Hq, Sq, D] over k, v [B, Hkv, Sk, D] (Sq <= Sk), bottom-right
    aligned (query i sees keys 0 .. Sk - Sq + i), with autograd, from `op` (``CudnnOp()`` or
    ``CpuFlashOp()``): the causal square and the non-causal prefix, merged by log-sum-exp."""
    if q.shape[2] > k.shape[2]:
        raise ValueError(f"invalid argument `k`: {k.shape[2]} keys, fewer than the {q.shape[2]} queries")
    return _LowerRightCausal.apply(q, k, v, op, scale)
