"""torch.library custom ops: cubeattn's calls as torch.compile / torch.export see them.

Under tracing (Dynamo, fake tensors) the attention functions of `cubeattn` route torch tensors
here: each call becomes one opaque op (`cubeattn::fwd_dense` / `fwd_varlen` / `fwd_grouped`) with
a fake implementation that gives the output shapes, and a backward op of its own, so a compiled
graph has no break at attention and AOTAutograd traces the backward. The ops' real
implementations are the eager functions (validation and dispatch stay there, asynchronous on
torch's current stream for CUDA tensors). Eager calls do not come through here. No maths here.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import (_batched_dims, _cu, _flag, _out_shape, _scale, _unsupported, _window, _check_device, _results,
               flash_attn_varlen_backward, flash_attn_varlen_func, grouped_flash_attn_backward, grouped_flash_attn_func)

_LIB = "cubeattn"


def _flat(x):
    """[batch, seqlen, heads, d] -> [batch * seqlen, heads, d] (a view where strides allow)."""
    return x.reshape(x.shape[0] * x.shape[1], x.shape[2], x.shape[3])


# ------------------------------------------------------------------ real implementations
# Each forward returns (out, lse) with lse [heads_q, total_q] float32 (the core's layout); each
# backward (dq, dk, dv). Options after v are those of the forward, deterministic included (the
# forward ignores it; autograd hands it to the backward).

@torch.library.custom_op(f"{_LIB}::fwd_dense", mutates_args=())
def fwd_dense(q: Tensor, k: Tensor, v: Tensor, softmax_scale: Optional[float], causal: bool, window_left: int,
              window_right: int, deterministic: bool, device: str) -> tuple[Tensor, Tensor]:
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    out, lse = flash_attn_varlen_func(_flat(q.detach()), _flat(k.detach()), _flat(v.detach()), _cu(b, sq), _cu(b, sk),
                                      sq, sk, 0.0, softmax_scale, causal, (window_left, window_right),
                                      return_lse=True, device=device)
    return out.reshape(_out_shape(q.shape, v.shape)), lse


@torch.library.custom_op(f"{_LIB}::bwd_dense", mutates_args=())
def bwd_dense(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, softmax_scale: Optional[float],
              causal: bool, window_left: int, window_right: int, deterministic: bool,
              device: str) -> tuple[Tensor, Tensor, Tensor]:
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    grads = flash_attn_varlen_backward(_flat(dout), _flat(q), _flat(k), _flat(v), _flat(out), lse, _cu(b, sq),
                                       _cu(b, sk), sq, sk, 0.0, softmax_scale, causal, (window_left, window_right),
                                       deterministic=deterministic, device=device)
    return tuple(g.reshape(x.shape) for g, x in zip(grads, (q, k, v)))


@torch.library.custom_op(f"{_LIB}::fwd_varlen", mutates_args=())
def fwd_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
               max_seqlen_k: int, softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int,
               deterministic: bool, device: str) -> tuple[Tensor, Tensor]:
    return flash_attn_varlen_func(q.detach(), k.detach(), v.detach(), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, 0.0, softmax_scale, causal, (window_left, window_right),
                                  return_lse=True, device=device)


@torch.library.custom_op(f"{_LIB}::bwd_varlen", mutates_args=())
def bwd_varlen(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
               cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: Optional[float], causal: bool,
               window_left: int, window_right: int, deterministic: bool,
               device: str) -> tuple[Tensor, Tensor, Tensor]:
    return flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      0.0, softmax_scale, causal, (window_left, window_right),
                                      deterministic=deterministic, device=device)


@torch.library.custom_op(f"{_LIB}::fwd_grouped", mutates_args=())
def fwd_grouped(q: Tensor, k: Tensor, v: Tensor, q_ranges: Tensor, kv_ranges: Tensor, softmax_scale: Optional[float],
                causal: bool, window_left: int, window_right: int, kv_block_table: Optional[Tensor],
                deterministic: bool, device: str) -> tuple[Tensor, Tensor]:
    return grouped_flash_attn_func(q.detach(), k.detach(), v.detach(), q_ranges, kv_ranges, 0.0, softmax_scale, causal,
                                   (window_left, window_right), return_lse=True, kv_block_table=kv_block_table,
                                   device=device)


@torch.library.custom_op(f"{_LIB}::bwd_grouped", mutates_args=())
def bwd_grouped(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, q_ranges: Tensor,
                kv_ranges: Tensor, softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int,
                kv_block_table: Optional[Tensor], deterministic: bool, device: str) -> tuple[Tensor, Tensor, Tensor]:
    return grouped_flash_attn_backward(dout, q, k, v, out, lse, q_ranges, kv_ranges, 0.0, softmax_scale, causal,
                                       (window_left, window_right), deterministic=deterministic,
                                       kv_block_table=kv_block_table, device=device)


# ------------------------------------------------------------------ fake (meta) implementations

def _empty(shape, like, dtype=None):
    return torch.empty(shape, dtype=like.dtype if dtype is None else dtype, device=like.device)


def _fake_fwd(q, k, v, *options):
    """out q's shape with v's head_dim (contiguous, as the real ones are), lse [heads_q, total_q]
    float32."""
    total_q = q.shape[0] * q.shape[1] if q.dim() == 4 else q.shape[0]
    return _empty(_out_shape(q.shape, v.shape), q), _empty((q.shape[-2], total_q), q, torch.float32)


def _fake_bwd(dout, q, k, v, out, lse, *options):
    return _empty(q.shape, q), _empty(k.shape, k), _empty(v.shape, v)


# ------------------------------------------------------------------ autograd

def _setup_context(ctx, inputs, output):
    """Saves q, k, v, out, lse and the options (tensor options through save_for_backward)."""
    q, k, v, *options = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.is_tensor = [isinstance(x, Tensor) for x in options]
    ctx.plain = [None if t else x for x, t in zip(options, ctx.is_tensor)]
    ctx.save_for_backward(q, k, v, out, lse, *(x for x in options if isinstance(x, Tensor)))


def _backward_through(bwd_op):
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, *tensors = ctx.saved_tensors
        it = iter(tensors)
        options = [next(it) if t else x for x, t in zip(ctx.plain, ctx.is_tensor)]
        dq, dk, dv = bwd_op(dout, q, k, v, out, lse, *options)
        return (dq, dk, dv) + (None,) * len(options)

    return backward


for _fwd, _bwd in ((fwd_dense, bwd_dense), (fwd_varlen, bwd_varlen), (fwd_grouped, bwd_grouped)):
    _fwd.register_fake(_fake_fwd)
    _bwd.register_fake(_fake_bwd)
    _fwd.register_autograd(_backward_through(_bwd), setup_context=_setup_context)


# ------------------------------------------------------------------ the public calls, traced (same arguments)

def _options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, device):
    """The checked options, by the eager path's own checks (all plain Python on constants)."""
    _unsupported(dropout_p, softcap, alibi_slopes)
    left, right = _window(window_size)
    return _scale(softmax_scale), _flag(causal, "causal"), left, right, _flag(deterministic, "deterministic"), \
        _check_device(device)


def _index_tensor(x):
    """cu_seqlens / ranges / block table as an int32 tensor (torch tensors pass as given: the real
    implementation validates them)."""
    if isinstance(x, Tensor):
        return x
    return torch.as_tensor(x, dtype=torch.int32)


def _maxlen(x):
    """max_seqlen as an int (a 0-d tensor is read with .item(): a graph break unless
    torch._dynamo.config.capture_scalar_outputs is set, as for flash-attn)."""
    return int(x.item()) if isinstance(x, Tensor) else x


def call_dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                    return_attn_probs, return_lse, device):
    scale, causal, left, right, det, device = _options(dropout_p, softmax_scale, causal, window_size, softcap,
                                                       alibi_slopes, deterministic, device)
    want_lse, probs = _flag(return_lse, "return_lse"), _flag(return_attn_probs, "return_attn_probs")
    _batched_dims(q, k, v)
    out, lse = fwd_dense(q, k, v, scale, causal, left, right, det, device)
    if not (want_lse or probs):
        return out
    lse = lse.reshape(q.shape[2], q.shape[0], q.shape[1]).permute(1, 0, 2)
    return _results(out, lse, want_lse, probs)


def call_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                           causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table,
                           return_lse, device):
    if block_table is not None:
        raise NotImplementedError("`block_table` (paged k, v) under torch.compile is not implemented by cubeattn; "
                                  "call it outside the compiled region (torch.compiler.disable)")
    scale, causal, left, right, det, device = _options(dropout_p, softmax_scale, causal, window_size, softcap,
                                                       alibi_slopes, deterministic, device)
    want_lse, probs = _flag(return_lse, "return_lse"), _flag(return_attn_probs, "return_attn_probs")
    out, lse = fwd_varlen(q, k, v, _index_tensor(cu_seqlens_q), _index_tensor(cu_seqlens_k),
                          _maxlen(max_seqlen_q), _maxlen(max_seqlen_k), scale, causal, left, right, det, device)
    if not (want_lse or probs):
        return out
    return _results(out, lse, want_lse, probs)


def call_grouped(q, k, v, q_ranges, kv_ranges, dropout_p, softmax_scale, causal, window_size, softcap,
                            alibi_slopes, deterministic, return_attn_probs, return_lse, kv_block_table, device):
    scale, causal, left, right, det, device = _options(dropout_p, softmax_scale, causal, window_size, softcap,
                                                       alibi_slopes, deterministic, device)
    want_lse, probs = _flag(return_lse, "return_lse"), _flag(return_attn_probs, "return_attn_probs")
    table = None if kv_block_table is None else _index_tensor(kv_block_table)
    out, lse = fwd_grouped(q, k, v, _index_tensor(q_ranges), _index_tensor(kv_ranges), scale, causal, left,
                           right, table, det, device)
    if not (want_lse or probs):
        return out
    return _results(out, lse, want_lse, probs)


def call_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                         softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, device):
    scale, causal, left, right, det, device = _options(dropout_p, softmax_scale, causal, window_size, softcap,
                                                       alibi_slopes, deterministic, device)
    return bwd_varlen(dout, q, k, v, out, lse, _index_tensor(cu_seqlens_q), _index_tensor(cu_seqlens_k),
                      _maxlen(max_seqlen_q), _maxlen(max_seqlen_k), scale, causal, left, right, det, device)


def call_grouped_backward(dout, q, k, v, out, lse, q_ranges, kv_ranges, dropout_p, softmax_scale, causal, window_size,
                          softcap, alibi_slopes, deterministic, kv_block_table, device):
    scale, causal, left, right, det, device = _options(dropout_p, softmax_scale, causal, window_size, softcap,
                                                       alibi_slopes, deterministic, device)
    table = None if kv_block_table is None else _index_tensor(kv_block_table)
    return bwd_grouped(dout, q, k, v, out, lse, _index_tensor(q_ranges), _index_tensor(kv_ranges), scale, causal, left,
                       right, table, det, device)
