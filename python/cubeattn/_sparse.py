"""Block-sparse attention: per (sequence, head, query block) a list of key blocks to attend;
everything else is skipped. A block index is one more key set of the one spec (`varlen_spec`'s
``block_index``; validated once in the native core, `src/spec.rs` / `src/sparse.rs`), and the
calls run through the package's one call path (`_forward` / `_run_backward`, autograd included).
This file converts block indices, FlexAttention masks, layouts and shapes. No maths here.

Block-size contract: query rows in blocks of ``q_block`` (default 64), keys in blocks of
``k_block`` (default 128), both counted from each sequence's start; the last block may be
partial. ``block_index`` is int32 ``[batch, heads, q_blocks, top_k]``, ``q_blocks =
ceil(max_seqlen_q / q_block)``, ``-1`` = unused slot, any order, no duplicates; ``heads`` is
heads_q or heads_kv (one pattern per GQA group). Causal (bottom-right) applies on top of the
block pattern. A row that sees no key gets zero output and lse ``+inf``. The results do not
depend on the device; on CUDA, ``k_block`` a multiple of 64 and ``q_block`` (times the GQA group
size when the index is per kv head) a multiple of 64 run without padded (masked) work.
"""
from __future__ import annotations

import numpy as np

from . import _batched_to_varlen, _core, _flag, _forward, _lse_batched, _run_backward, _scale
from ._arrays import _is_torch, dtype_name, int32_vector, to_core

DEFAULT_Q_BLOCK = 64
DEFAULT_K_BLOCK = 128
QUANT_GRANS = ("per_block", "per_warp", "per_thread")


def _int(x, name, lo=0):
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < lo:
        raise ValueError(f"invalid argument `{name}`: expected an int >= {lo}, got {x!r}")
    return int(x)


def _index_array(x, name):
    """Any integer array-like (numpy, torch, nested lists) -> (C-contiguous int32 array, shape)."""
    if _is_torch(x):
        x = x.detach().cpu().numpy()
    try:
        a = np.asarray(x)
    except Exception as e:  # ragged lists and the like
        raise ValueError(f"invalid argument `{name}`: not a rectangular integer array ({e})") from None
    if a.dtype.kind not in "iu":
        raise TypeError(f"invalid dtype for `{name}`: {a.dtype}; expected int32")
    if a.size and a.dtype.itemsize >= 4 and a.dtype != np.int32:  # int32 (and narrower) always fit
        lo, hi = np.iinfo(np.int32).min, np.iinfo(np.int32).max
        bad = np.argwhere((a < lo) | (a > hi))
        if len(bad):
            pos = ", ".join(str(int(i)) for i in bad[0])
            raise ValueError(f"invalid argument `{name}`: {name}[{pos}] = {a[tuple(bad[0])]} does not fit in int32")
    return np.ascontiguousarray(a, dtype=np.int32)


def _flex_fields(block_mask, kv_num_blocks, kv_indices):
    """(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, block_size) from a
    FlexAttention BlockMask or from the two arrays."""
    if block_mask is not None:
        if kv_num_blocks is not None or kv_indices is not None:
            raise ValueError("invalid argument `block_mask`: give a BlockMask or kv_num_blocks/kv_indices, not both")
        for f in ("kv_num_blocks", "kv_indices"):
            if not hasattr(block_mask, f):
                raise TypeError(f"invalid argument `block_mask`: expected a FlexAttention BlockMask (with kv_num_blocks "
                                f"and kv_indices), got {type(block_mask).__name__}")
        bs = getattr(block_mask, "BLOCK_SIZE", None)
        return (block_mask.kv_num_blocks, block_mask.kv_indices, getattr(block_mask, "full_kv_num_blocks", None),
                getattr(block_mask, "full_kv_indices", None), tuple(int(x) for x in bs) if bs is not None else None)
    if (kv_num_blocks is None) != (kv_indices is None):
        raise ValueError("invalid argument `kv_indices`: kv_num_blocks and kv_indices go together")
    return kv_num_blocks, kv_indices, None, None, None


def block_index_from_flex(kv_num_blocks, kv_indices, full_kv_num_blocks=None, full_kv_indices=None):
    """FlexAttention BlockMask fields -> block_index int32 ``[B, H, q_blocks, top_k]`` (-1 padded):
    row (b, h, qb) keeps ``kv_indices[b, h, qb, :kv_num_blocks[b, h, qb]]`` plus, when given, the
    full blocks ``full_kv_indices[b, h, qb, :full_kv_num_blocks[b, h, qb]]``. Every kept block is
    attended in full (a mask_mod inside a partial block is not applied; causal=True gives the
    causal one)."""
    num = _index_array(kv_num_blocks, "kv_num_blocks")
    idx = _index_array(kv_indices, "kv_indices")
    full = ()
    if (full_kv_num_blocks is None) != (full_kv_indices is None):
        raise ValueError("invalid argument `full_kv_indices`: full_kv_num_blocks and full_kv_indices go together")
    if full_kv_num_blocks is not None:
        fn = _index_array(full_kv_num_blocks, "full_kv_num_blocks")
        fi = _index_array(full_kv_indices, "full_kv_indices")
        full = (fn.reshape(-1), list(fn.shape), fi.reshape(-1), list(fi.shape))
    flat, shape = _core.flex_block_index(num.reshape(-1), list(num.shape), idx.reshape(-1), list(idx.shape), *full)
    return np.asarray(flat).reshape(shape)


def _resolve_index(block_index, block_mask, kv_num_blocks, kv_indices, q_block, k_block, batch, heads_q):
    """-> (block_index int32 array, q_block, k_block)."""
    if block_index is not None and hasattr(block_index, "kv_indices") and block_mask is None:
        block_index, block_mask = None, block_index  # a BlockMask passed positionally
    q_block = _int(q_block, "q_block", 1)
    k_block = _int(k_block, "k_block", 1)
    if block_index is not None:
        if block_mask is not None or kv_num_blocks is not None or kv_indices is not None:
            raise ValueError("invalid argument `block_index`: give block_index, or a BlockMask / kv_num_blocks+kv_indices, not both")
        return _index_array(block_index, "block_index"), q_block, k_block
    num, idx, fnum, fidx, bs = _flex_fields(block_mask, kv_num_blocks, kv_indices)
    if num is None:
        raise ValueError("invalid argument `block_index`: required (or a FlexAttention block_mask / kv_num_blocks+kv_indices)")
    if bs is not None:
        if (q_block, k_block) not in ((DEFAULT_Q_BLOCK, DEFAULT_K_BLOCK), bs):
            raise ValueError(f"invalid argument `q_block`: ({q_block}, {k_block}) differs from the BlockMask's BLOCK_SIZE {bs}")
        q_block, k_block = bs
    ix = block_index_from_flex(num, idx, fnum, fidx)
    # FlexAttention broadcasts a batch or head dimension of 1 (masks made with B=None / H=None)
    b, h = ix.shape[0], ix.shape[1]
    if (b == 1 and batch != 1) or (h == 1 and heads_q != 1):
        ix = np.ascontiguousarray(np.broadcast_to(ix, (batch if b == 1 else b, heads_q if h == 1 else h) + ix.shape[2:]))
    return ix, q_block, k_block


def _layout(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """-> (flat q, k, v, cu_q, cu_k, max_q, max_k, batched (B, Sq) or None)."""
    if cu_seqlens_q is None and cu_seqlens_k is None:
        (fq, fk, fv), cu_q, cu_k, b, sq, sk = _batched_to_varlen(q, k, v)
        return fq, fk, fv, cu_q, cu_k, sq, sk, (b, sq)
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise ValueError("invalid argument `cu_seqlens_k`: cu_seqlens_q and cu_seqlens_k go together")
    cu_q, cu_k = int32_vector(cu_seqlens_q, "cu_seqlens_q"), int32_vector(cu_seqlens_k, "cu_seqlens_k")
    mq = int(np.diff(cu_q).max()) if cu_q.size > 1 else 0
    mk = int(np.diff(cu_k).max()) if cu_k.size > 1 else 0
    mq = mq if max_seqlen_q is None else _int(max_seqlen_q, "max_seqlen_q")
    mk = mk if max_seqlen_k is None else _int(max_seqlen_k, "max_seqlen_k")
    return q, k, v, cu_q, cu_k, mq, mk, None


def _quant_gran(quant_gran, qk_int8, smooth_k):
    """The INT8 granularity a call asks for (None: exact QK^T). ``quant_gran`` turns it on;
    ``qk_int8=True`` alone means "per_warp" (the older spelling); ``qk_int8=False`` with a
    ``quant_gran`` is a contradiction."""
    if qk_int8 is not None and not isinstance(qk_int8, (bool, np.bool_)):
        raise TypeError(f"invalid argument `qk_int8`: expected a bool or None, got {qk_int8!r}")
    if not isinstance(smooth_k, (bool, np.bool_)):
        raise TypeError(f"invalid argument `smooth_k`: expected a bool, got {smooth_k!r}")
    if quant_gran is not None and (not isinstance(quant_gran, str) or quant_gran not in QUANT_GRANS):
        raise ValueError(f"invalid argument `quant_gran`: must be None or one of {QUANT_GRANS}, got {quant_gran!r}")
    if qk_int8 is False and quant_gran is not None:
        raise ValueError(f"invalid argument `quant_gran`: {quant_gran!r} asks for INT8 Q K^T but qk_int8=False")
    if qk_int8 and quant_gran is None:
        return "per_warp"
    return quant_gran


def _pv_fp8(pv_precision, quant_gran):
    """Whether a call asks for FP8 P.V: ``pv_precision`` None (P.V in the input's float type) or
    "fp8" (only with the INT8 Q K^T option, ``quant_gran`` the resolved granularity)."""
    if not (pv_precision is None or (isinstance(pv_precision, str) and pv_precision == "fp8")):
        raise ValueError(f"invalid argument `pv_precision`: must be None (P.V in the input's float type) or \"fp8\", "
                         f"got {pv_precision!r}")
    if pv_precision == "fp8" and quant_gran is None:
        raise ValueError("invalid argument `pv_precision`: \"fp8\" (FP8 P.V) needs the INT8 Q K^T option; pass "
                         "quant_gran=\"per_warp\" (or \"per_block\" / \"per_thread\")")
    return pv_precision == "fp8"


def sparse_spec(q_shape, k_shape, dtype, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_index,
                q_block=DEFAULT_Q_BLOCK, k_block=DEFAULT_K_BLOCK, softmax_scale=None, causal=False, v_shape=None,
                quant_gran=None, smooth_k=True, qk_int8=None, pv_precision=None):
    """A validated block-sparse spec (varlen layout; shapes only, no data needed). ``quant_gran``
    (None, "per_block", "per_warp", "per_thread") fixes the INT8 Q K^T option of the calls that use
    it; ``qk_int8`` is accepted as before (a granularity name, or True for "per_warp");
    ``pv_precision`` (None, or "fp8" with a ``quant_gran``) the FP8 P.V option. A call
    with the same arguments and an index of the same contents as one of the last few returns that
    call's spec (compared element by element, so it is exact: the per-call cost of a repeated
    index is a comparison, not a validation)."""
    ix = _index_array(block_index, "block_index")
    if isinstance(qk_int8, str):  # the older spelling: the granularity passed as qk_int8
        quant_gran, qk_int8 = (qk_int8 if quant_gran is None else quant_gran), None
    quant_gran = _quant_gran(quant_gran, qk_int8, smooth_k)
    pv_fp8 = _pv_fp8(pv_precision, quant_gran)
    shapes = [list(q_shape), list(k_shape), list(k_shape if v_shape is None else v_shape)]
    cu_q, cu_k = int32_vector(cu_seqlens_q, "cu_seqlens_q"), int32_vector(cu_seqlens_k, "cu_seqlens_k")
    scalars = [_int(max_seqlen_q, "max_seqlen_q"), _int(max_seqlen_k, "max_seqlen_k"), _scale(softmax_scale),
               bool(causal)]
    blocks = [_int(q_block, "q_block", 1), _int(k_block, "k_block", 1), quant_gran, bool(smooth_k), pv_fp8]
    # everything but the index's contents, which are compared element by element
    key = (repr(shapes), dtype, cu_q.tobytes(), cu_k.tobytes(), *scalars, ix.shape, *blocks)
    for i, (k, cached_ix, spec) in enumerate(_SPECS):
        if k == key and np.array_equal(cached_ix, ix):
            _SPECS.insert(0, _SPECS.pop(i))
            return spec
    spec = _core.varlen_spec(*shapes, dtype, cu_q, cu_k, *scalars, (-1, -1), ix.reshape(-1), list(ix.shape), *blocks)
    if ix.nbytes <= _SPEC_CACHE_BYTES:
        _SPECS.insert(0, (key, ix.copy(), spec))
        del _SPECS[_SPEC_CACHE_ENTRIES:]
    return spec


# The last few validated specs with their arguments and a copy of their index (most recent first).
_SPECS: list = []
_SPEC_CACHE_ENTRIES = 4
_SPEC_CACHE_BYTES = 64 << 20


def _lse_flat(lse, b, sq):
    """[b, heads, sq] -> [heads, b * sq] (a torch tensor stays on its device)."""
    if not _is_torch(lse):
        lse = np.asarray(lse, dtype=np.float32)
    if lse.ndim != 3 or lse.shape[0] != b or lse.shape[2] != sq:
        raise ValueError(f"invalid argument `lse`: expected shape [batch={b}, heads, seqlen_q={sq}], got {tuple(lse.shape)}")
    if _is_torch(lse):
        return lse.detach().float().permute(1, 0, 2).reshape(lse.shape[1], b * sq)
    return np.ascontiguousarray(lse.transpose(1, 0, 2)).reshape(lse.shape[1], b * sq)


def block_sparse_attn_func(q, k, v, block_index=None, q_block=DEFAULT_Q_BLOCK, k_block=DEFAULT_K_BLOCK, causal=False,
                           softmax_scale=None, return_lse=False, device="auto", cu_seqlens_q=None, cu_seqlens_k=None,
                           max_seqlen_q=None, max_seqlen_k=None, qk_int8=None, quant_gran=None, smooth_k=True,
                           block_mask=None, kv_num_blocks=None, kv_indices=None, deterministic=False,
                           pv_precision=None):
    """Block-sparse attention. Batched: q ``[B, Sq, Hq, d]``, k/v ``[B, Sk, Hkv, d]``; varlen (with
    cu_seqlens_q/cu_seqlens_k): q ``[total_q, Hq, d]``, k/v ``[total_k, Hkv, d]``. ``block_index``
    int32 ``[B, H, q_blocks, top_k]`` (see the module docs), or a FlexAttention ``block_mask`` /
    its ``kv_num_blocks`` + ``kv_indices``. Returns out (and lse: ``[B, Hq, Sq]`` batched,
    ``[Hq, total_q]`` varlen). ``quant_gran`` ("per_block", "per_warp", "per_thread"; default None =
    exact): SageAttention-style INT8 Q K^T with that scale granularity and K smoothing
    (``smooth_k``), forward only (``qk_int8=True`` alone means "per_warp"); CUDA for
    float16/bfloat16, the CPU emulates it bit for bit in the quantisation (float32 too).
    ``pv_precision``: None (default: P.V in the input's float type) or "fp8" (SageAttention2's FP8
    e4m3 P.V: V per channel, P scaled by 256; needs ``quant_gran``; forward only; emulated on the
    CPU, docs/sparse.md has the exact rule). ``block_index`` may also be a
    SparseSpec from ``cubeattn.sparse_spec`` (the index validated once, as a FlexAttention BlockMask
    is built once): the call must match its shapes, sequences and dtype. Forward on CUDA (torch
    CUDA tensors stay on their GPU; numpy inputs are copied) for float16/bfloat16, head_dim up to
    128 (64 and 128 natively, the others padded to them with zero columns), exact QK^T; the rest runs on the CPU with ``device="auto"`` and raises NotImplementedError
    with ``device="cuda"``. The backward (torch autograd, or block_sparse_attn_backward) follows
    the same rule; on torch CUDA tensors it is enqueued on the current stream with no copies.
    ``deterministic`` (autograd's backward; flash-attn's meaning and default): False adds dQ up with
    float atomics on CUDA (faster; last-bit differences run to run), True gives bitwise-identical
    gradients; the CPU is deterministic either way."""
    deterministic = _flag(deterministic, "deterministic")
    cq0 = dtype_name(q, "q")
    dtype_name(k, "k"), dtype_name(v, "v")
    fq, fk, fv, cu_q, cu_k, mq, mk, batched = _layout(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    heads_q = fq.shape[1] if len(fq.shape) == 3 else 0
    if isinstance(block_index, _core.Spec):
        gran = _quant_gran(quant_gran, qk_int8, smooth_k)
        spec = _prepared(block_index, fq, fk, fv, cq0, cu_q, cu_k, q_block, k_block, causal, softmax_scale, gran,
                         pv_precision, block_mask, kv_num_blocks, kv_indices)
        cq, ck, cv = to_core(fq, "q"), to_core(fk, "k"), to_core(fv, "v")
    else:
        ix, q_block, k_block = _resolve_index(block_index, block_mask, kv_num_blocks, kv_indices, q_block, k_block,
                                              len(cu_q) - 1, heads_q)
        gran = _quant_gran(quant_gran, qk_int8, smooth_k)
        _pv_fp8(pv_precision, gran)
        cq, ck, cv = to_core(fq, "q"), to_core(fk, "k"), to_core(fv, "v")
        spec = sparse_spec(cq.shape, ck.shape, cq0, cu_q, cu_k, mq, mk, ix, q_block, k_block, softmax_scale, causal,
                           v_shape=cv.shape, quant_gran=gran, smooth_k=smooth_k, pv_precision=pv_precision)
    out, lse = _forward(spec, fq, fk, fv, cq, ck, cv, True, deterministic, device)
    if batched is not None:
        out = out.reshape(q.shape)
        lse = _lse_batched(lse, *batched)
    return (out, lse) if return_lse else out


def _prepared(spec, fq, fk, fv, dtype, cu_q, cu_k, q_block, k_block, causal, softmax_scale, qk_int8, pv_precision,
              *mask_args):
    """A SparseSpec passed as `block_index` (built once with `cubeattn.sparse_spec`): the call must
    match it; the arguments it fixes must be left at their defaults or agree with it."""
    if spec.key_set != "block_sparse":
        raise ValueError(f"invalid argument `block_index`: a spec of key set {spec.key_set!r}; give a block index or "
                         "a SparseSpec from cubeattn.sparse_spec")
    if any(a is not None for a in mask_args):
        raise ValueError("invalid argument `block_mask`: give a prepared SparseSpec or a block mask, not both")
    for name, got, default, want in (("q_block", q_block, DEFAULT_Q_BLOCK, spec.q_block),
                                     ("k_block", k_block, DEFAULT_K_BLOCK, spec.k_block),
                                     ("causal", causal, False, spec.causal)):
        if got != default and got != want:
            raise ValueError(f"invalid argument `{name}`: {got!r} differs from the prepared SparseSpec's {want!r}")
    if softmax_scale is not None and abs(float(softmax_scale) - spec.softmax_scale) > 1e-6 * abs(spec.softmax_scale):
        raise ValueError(f"invalid argument `softmax_scale`: {softmax_scale!r} differs from the prepared SparseSpec's "
                         f"{spec.softmax_scale!r}")
    if qk_int8 is not None:
        raise ValueError("invalid argument `quant_gran`: a prepared SparseSpec fixes it (build it with quant_gran=...)")
    if pv_precision is not None:
        raise ValueError("invalid argument `pv_precision`: a prepared SparseSpec fixes it (build it with "
                         "pv_precision=...)")
    dims = (fq.shape[0], fk.shape[0], fq.shape[1], fk.shape[1], fq.shape[2]) if len(fq.shape) == 3 else None
    if dims != tuple(spec.dims) or tuple(fv.shape) != tuple(fk.shape) or dtype != spec.dtype:
        raise ValueError(f"invalid argument `block_index`: the prepared SparseSpec is for dims {tuple(spec.dims)} "
                         f"{spec.dtype}, the call has q {tuple(fq.shape)} k {tuple(fk.shape)} {dtype}")
    segs = [(int(cu_q[i]), int(cu_q[i + 1] - cu_q[i]), int(cu_k[i]), int(cu_k[i + 1] - cu_k[i]))
            for i in range(len(cu_q) - 1)]
    if segs != [tuple(x) for x in spec.segments]:
        raise ValueError("invalid argument `block_index`: the prepared SparseSpec's sequences (cu_seqlens) differ "
                         "from the call's")
    return spec


def block_sparse_attn_backward(dout, q, k, v, out, lse, block_index=None, q_block=DEFAULT_Q_BLOCK,
                               k_block=DEFAULT_K_BLOCK, causal=False, softmax_scale=None, device="auto",
                               cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                               block_mask=None, kv_num_blocks=None, kv_indices=None, deterministic=False):
    """Gradients (dq, dk, dv) of block_sparse_attn_func (exact QK^T) given dout, its out and lse,
    in the layout of the forward call (lse ``[B, Hq, Sq]`` batched, ``[Hq, total_q]`` varlen).
    ``deterministic=True`` gives bitwise-identical gradients run to run on every device; False (the
    default, as in flash-attn) lets the CUDA kernels add dQ up with float atomics (faster; dk and
    dv stay deterministic, dq may differ in the last bits). CUDA for
    float16/bfloat16, head_dim up to 128 (torch CUDA tensors stay on their GPU); the CPU otherwise
    with ``device="auto"``, NotImplementedError with ``device="cuda"``."""
    deterministic = _flag(deterministic, "deterministic")
    dt = dtype_name(q, "q")
    for name, x in (("k", k), ("v", v), ("out", out), ("dout", dout)):
        dtype_name(x, name)
    fq, fk, fv, cu_q, cu_k, mq, mk, batched = _layout(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    heads_q = fq.shape[1] if len(fq.shape) == 3 else 0
    ix, q_block, k_block = _resolve_index(block_index, block_mask, kv_num_blocks, kv_indices, q_block, k_block,
                                          len(cu_q) - 1, heads_q)
    spec = sparse_spec(tuple(fq.shape), tuple(fk.shape), dt, cu_q, cu_k, mq, mk, ix, q_block, k_block,
                       softmax_scale, causal, v_shape=tuple(fv.shape))
    if batched is not None:
        for name, x in (("dout", dout), ("out", out)):
            if tuple(x.shape) != tuple(q.shape):
                raise ValueError(f"invalid argument `{name}`: shape {tuple(x.shape)} differs from q's {tuple(q.shape)}")
        dout, out = dout.reshape(fq.shape), out.reshape(fq.shape)
        lse = _lse_flat(lse, *batched)
    dq, dk, dv = _run_backward(spec, dout, fq, fk, fv, out, lse, deterministic, device)
    if batched is not None:
        dq, dk, dv = dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)
    return dq, dk, dv
