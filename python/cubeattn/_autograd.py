"""torch.autograd glue: when q, k or v is a torch tensor that requires grad (and grad mode is on),
the attention functions return an output attached to the autograd graph; its backward runs the
cubeattn backward (same spec, same backend choice). No maths here."""
from __future__ import annotations

import torch


class _Attention(torch.autograd.Function):
    """out, lse = attention(q, k, v) for one validated spec; lse is not differentiable.
    `conv`: q, k, v already converted for the core (see `_arrays.to_core`)."""

    @staticmethod
    def forward(ctx, q, k, v, spec, conv, deterministic, device, ready=None):
        if ready is not None:
            # a repeat of a call the validating path served on the device (`_fast_forward`): q, k,
            # v are the contiguous CUDA tensors the kernels read; `ready` = (gpu, dev, workspace)
            from . import _enqueue_forward, _out_shape

            gpu, dev, w = ready
            out, lse = _enqueue_forward(torch, spec, gpu, dev, w, q, k, v, _out_shape(q.shape, v.shape), True)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.fast = (gpu, dev)
        else:
            from . import _device_for, _one_gpu, _run_forward

            out, lse = _run_forward(spec, *conv, True, device)
            dev = _device_for(device, *conv)
            gpu = _one_gpu(dev, *conv)
            if gpu is not None and out.is_cuda:
                # device path: keep the contiguous tensors the kernels read, so that the backward
                # only has dout to check and convert
                ctx.save_for_backward(*(c.device_tensor for c in conv), out, lse)
                ctx.fast = (gpu, dev)
            else:
                ctx.save_for_backward(q, k, v, out, lse)
                ctx.fast = None
        ctx.spec, ctx.deterministic, ctx.device = spec, deterministic, device
        ctx.mark_non_differentiable(lse)
        # lse's gradient is never used: no zeros tensor made (and filled on the device) per call
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        from . import _backward_device_fast, _run_backward

        if dout is None:  # out took no part in the loss: no gradient (None is zero to autograd)
            return None, None, None, None, None, None, None, None
        q, k, v, out, lse = ctx.saved_tensors
        if ctx.fast is not None:
            grads = _backward_device_fast(ctx.spec, *ctx.fast, q, k, v, out, lse, dout, ctx.deterministic)
            if grads is not None:
                return (*grads, None, None, None, None, None)
        dq, dk, dv = _run_backward(ctx.spec, dout, q, k, v, out, lse, ctx.deterministic, ctx.device)
        return dq, dk, dv, None, None, None, None, None


def needs_grad(*xs) -> bool:
    """True when grad mode is on and one of `xs` is a torch tensor that requires grad."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in xs)


def attention_on_gpu(spec, gpu, dev, w, q, k, v, deterministic, device):
    """The differentiable forward of a repeated batched call (`_fast_forward`: the cached spec, its
    device `dev` / `gpu` and workspace `w`; q, k, v contiguous CUDA tensors): out only."""
    return _Attention.apply(q, k, v, spec, None, deterministic, device, (gpu, dev, w))[0]


def attention(spec, q, k, v, conv, return_lse, deterministic, device):
    """The differentiable forward; q, k, v must all be torch tensors."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"invalid argument `{name}`: with torch inputs that require grad, q, k and v must "
                            f"all be torch tensors, got {type(x).__name__}")
    out, lse = _Attention.apply(q, k, v, spec, conv, deterministic, device)
    return (out, lse) if return_lse else out
