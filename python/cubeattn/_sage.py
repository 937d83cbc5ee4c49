"""Dense attention with SageAttention-style INT8 Q K^T (issue 43): ``sageattn``.

No kernel of its own: the call is the block-sparse forward (`_sparse.py`) with every key block
listed (causal: every key block some row of the query block can see), 128-row query blocks and
128-key blocks, and the INT8 option of that path (``quant_gran``, ``smooth_k``, and its FP8 P.V,
``pv_precision="fp8"``). The index and
the validated SparseSpec are built once per call shape and kept here, so a repeated call costs a
dict lookup, not an index build and a validation. No maths here.
"""
from __future__ import annotations

import numpy as np

from . import _cu, _check_device, _flag, _needs_grad, _scale
from ._arrays import _is_torch, dtype_name
from ._sparse import _pv_fp8, _quant_gran, block_sparse_attn_func, sparse_spec

SAGE_BLOCK = 128  # q_block = k_block of the underlying block-sparse call
TENSOR_LAYOUTS = ("NHD", "HND")

# (batch, index heads, seqlen_q, seqlen_k, causal) -> read-only int32 index [B, H, q_blocks, k_blocks].
# The causal listing depends on seqlen_k - seqlen_q (bottom-right alignment), not only on the block
# counts, so the sequence lengths are part of the key. The index is a host array whatever the device
# (the CUDA backend keeps its own device copy per (shape, index)).
_INDEX: dict = {}
# (q, k, v shapes, dtype, softmax_scale, causal, quant_gran, smooth_k, pv_precision) -> prepared SparseSpec
_SPECS: dict = {}
_CACHE_ENTRIES = 16


def _remember(cache, key, value):
    if len(cache) >= _CACHE_ENTRIES:
        del cache[next(iter(cache))]  # the oldest entry
    cache[key] = value
    return value


def dense_block_index(batch, heads, seqlen_q, seqlen_k, causal, block=SAGE_BLOCK):
    """int32 ``[batch, heads, ceil(seqlen_q / block), ceil(seqlen_k / block)]``: every key block for
    every query block; with ``causal`` (bottom-right: row r sees keys j <= r + seqlen_k - seqlen_q)
    the key blocks 0 .. b where b is the block of the last key the query block's last row sees, then
    -1 (a query block whose rows see no key lists none). The per-element causal mask of the
    block-sparse call does the rest inside the listed blocks."""
    qbn, kbn = -(-seqlen_q // block), -(-seqlen_k // block)
    kb = np.arange(kbn, dtype=np.int32)
    if causal:
        last_row = np.minimum((np.arange(qbn, dtype=np.int64) + 1) * block, seqlen_q) - 1
        last_key = last_row + (seqlen_k - seqlen_q)  # < 0: the block's rows see no key
        count = np.clip(np.floor_divide(last_key, block) + 1, 0, kbn)
        rows = np.where(kb[None, :] < count[:, None], kb[None, :], np.int32(-1))
    else:
        rows = np.broadcast_to(kb, (qbn, kbn))
    ix = np.ascontiguousarray(np.broadcast_to(rows, (batch, heads, qbn, kbn)), dtype=np.int32)
    ix.setflags(write=False)
    return ix


def _index(batch, heads, seqlen_q, seqlen_k, causal):
    key = (batch, heads, seqlen_q, seqlen_k, causal)
    ix = _INDEX.get(key)
    if ix is None:
        ix = _remember(_INDEX, key, dense_block_index(batch, heads, seqlen_q, seqlen_k, causal))
    return ix


def _spec(dtype, b, sq, sk, hq, hkv, d, softmax_scale, causal, quant_gran, smooth_k, pv_precision):
    key = (dtype, b, sq, sk, hq, hkv, d, softmax_scale, causal, quant_gran, smooth_k, pv_precision)
    spec = _SPECS.get(key)
    if spec is None:
        ix = _index(b, hkv, sq, sk, causal)  # one pattern per kv head (GQA groups share it)
        spec = sparse_spec((b * sq, hq, d), (b * sk, hkv, d), dtype, _cu(b, sq), _cu(b, sk), sq, sk, ix, SAGE_BLOCK,
                           SAGE_BLOCK, softmax_scale, causal, v_shape=(b * sk, hkv, d), quant_gran=quant_gran,
                           smooth_k=smooth_k, pv_precision=pv_precision)
        _remember(_SPECS, key, spec)
    return spec


def _swap(x):
    """[B, a, b, d] -> [B, b, a, d] as a view (numpy or torch)."""
    return x.transpose(1, 2) if _is_torch(x) else np.swapaxes(x, 1, 2)


def _check_layout(tensor_layout):
    if not isinstance(tensor_layout, str):
        raise TypeError(f"invalid argument `tensor_layout`: expected 'NHD' or 'HND', got {type(tensor_layout).__name__} "
                        f"{tensor_layout!r}")
    if tensor_layout not in TENSOR_LAYOUTS:
        raise ValueError(f"invalid argument `tensor_layout`: expected 'NHD' ([batch, seqlen, heads, head_dim]) or "
                         f"'HND' ([batch, heads, seqlen, head_dim]), got {tensor_layout!r}")
    return tensor_layout


def _dims(q, k, v, tensor_layout):
    """(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim) of the call, checked."""
    names = "[batch, seqlen, heads, head_dim]" if tensor_layout == "NHD" else "[batch, heads, seqlen, head_dim]"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(x.shape) != 4:
            raise ValueError(f"invalid argument `{name}`: expected rank 4 {names} (tensor_layout={tensor_layout!r}), "
                             f"got shape {tuple(x.shape)}")
    s_ax, h_ax = (1, 2) if tensor_layout == "NHD" else (2, 1)
    b, sq, hq, d = q.shape[0], q.shape[s_ax], q.shape[h_ax], q.shape[3]
    sk, hkv = k.shape[s_ax], k.shape[h_ax]
    for name, x in (("k", k), ("v", v)):
        if x.shape[0] != b:
            raise ValueError(f"invalid argument `{name}`: batch {x.shape[0]} differs from q's batch {b}")
        if x.shape[3] != d:
            raise ValueError(f"invalid argument `{name}`: head_dim {x.shape[3]} differs from q's head_dim {d}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"invalid argument `v`: shape {tuple(v.shape)} differs from k's {tuple(k.shape)}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"invalid argument `k`: {hkv} kv heads do not divide q's {hq} heads (GQA needs heads_q % "
                         "heads_kv == 0)")
    return b, sq, sk, hq, hkv, d


def sageattn(q, k, v, is_causal=False, softmax_scale=None, quant_gran="per_warp", smooth_k=True, return_lse=False,
             device="auto", tensor_layout="NHD", pv_precision=None):
    """Dense attention with SageAttention's INT8 Q K^T (forward only).

    q ``[B, Sq, Hq, d]``, k/v ``[B, Sk, Hkv, d]`` with ``tensor_layout="NHD"``; ``[B, H, S, d]`` with
    ``"HND"`` (the output has q's layout; an HND output is a transposed view). GQA: Hkv divides Hq.
    ``is_causal``: bottom-right aligned when Sq != Sk (row r sees keys j <= r + Sk - Sq; rows that see
    no key get zero output and lse +inf), as everywhere in cubeattn. ``softmax_scale`` defaults to
    1 / sqrt(d). ``quant_gran``: "per_block", "per_warp" (default) or "per_thread" INT8 scales for
    Q and K (see docs/api.md, block-sparse INT8), or None for the exact 16-bit Q K^T; ``smooth_k``
    subtracts K's mean over the sequence before quantising (the softmax is unchanged). Returns out,
    or (out, lse) with ``return_lse`` (lse float32 ``[B, Hq, Sq]``, the lse of the unsmoothed scores).
    ``pv_precision``: None (default: P.V in the input's float type, P rounded to it, f32
    accumulation) or "fp8" (SageAttention2's FP8 e4m3 P.V: V quantised per (sequence, kv head,
    channel) with scale amax / 448, P scaled by 256 and rounded to e4m3; needs ``quant_gran``; the
    CPU emulates it, docs/sparse.md has the exact rule).

    Runs as the block-sparse forward with every key block listed (q_block = k_block = 128); the
    index and the validated spec are cached per call shape. With a quantised Q K^T there is no
    backward: torch inputs that require grad raise ValueError naming ``quant_gran`` (run under
    torch.no_grad()); with ``quant_gran=None`` autograd flows through the block-sparse backward.
    Devices as for ``block_sparse_attn_func``: CUDA for float16/bfloat16 with head_dim 64/128; the
    CPU emulates the quantisation (float32 too)."""
    tensor_layout = _check_layout(tensor_layout)
    causal = _flag(is_causal, "is_causal")
    smooth_k = _flag(smooth_k, "smooth_k")
    want_lse = _flag(return_lse, "return_lse")
    quant_gran = _quant_gran(quant_gran, None, smooth_k)
    pv_precision = "fp8" if _pv_fp8(pv_precision, quant_gran) else None
    softmax_scale = _scale(softmax_scale)
    if softmax_scale is not None and not (np.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"invalid argument `softmax_scale`: expected a finite positive float or None, got "
                         f"{softmax_scale!r}")
    _check_device(device)
    dt = dtype_name(q, "q")
    for name, x in (("k", k), ("v", v)):
        other = dtype_name(x, name)
        if other != dt:
            raise TypeError(f"invalid dtype for `{name}`: {other}; q is {dt} (they must match)")
    b, sq, sk, hq, hkv, d = _dims(q, k, v, tensor_layout)
    if quant_gran is not None and _needs_grad(q, k, v):
        raise ValueError(f"invalid argument `quant_gran`: {quant_gran!r} (INT8 Q K^T) is forward-only, the quantised "
                         "path has no backward; run it under torch.no_grad(), on inputs that do not require grad, or "
                         "with quant_gran=None (exact Q K^T, differentiable)")
    spec = _spec(dt, b, sq, sk, hq, hkv, d, softmax_scale, causal, quant_gran, smooth_k, pv_precision)
    if tensor_layout == "HND":
        q, k, v = _swap(q), _swap(k), _swap(v)
    res = block_sparse_attn_func(q, k, v, spec, return_lse=want_lse, device=device)
    if tensor_layout == "HND":
        res = (_swap(res[0]), res[1]) if want_lse else _swap(res)
    return res
