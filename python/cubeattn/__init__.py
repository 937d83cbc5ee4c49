"""cubeattn: flash, grouped (shared K,V, overlapping key ranges), varlen, paged and block-sparse
attention, all through one validated spec (its key set: dense, paged or block-sparse) and one call
path (`_forward` / `_run_backward`, `_autograd`).

CubeCL CUDA kernels when the wheel was built with the ``cuda`` feature and a GPU is present; an
exact multi-threaded CPU backend otherwise, with the same API. Names and argument order follow
flash-attn. Layout: q ``[total_q, heads_q, head_dim]``, k/v ``[total_k, heads_kv, head_dim]``
(v may have a head_dim of its own, as DeepSeek's MLA with 192 / 128: out then has v's);
lse ``[heads_q, total_q]`` float32. Rows that see no key get zero output and lse ``+inf``.
torch tensors that require grad give an output attached to the autograd graph (its backward is
cubeattn's backward; ``deterministic=`` picks the dQ path as in the explicit backward calls).
``device``: "auto" (CUDA when it starts and has a kernel for the call, else the CPU), "cpu",
"cuda" or "cuda:N"; with torch CUDA tensors, "auto" and "cuda" mean the tensors' own GPU.
"""
from __future__ import annotations

import os
import threading
import warnings

import numpy as np

from . import _core, _fp8
from ._arrays import _is_torch, dense_cuda, dtype_name, is_dense_cuda, from_core, int32_ranges, int32_vector, to_core

__all__ = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_backward",
    "flash_attn_with_kvcache",
    "grouped_flash_attn_func",
    "grouped_flash_attn_backward",
    "devices",
    "backend_status",
    "estimate_vram",
    "last_backend",
    "varlen_spec",
    "grouped_spec",
    "warmup",
    "block_sparse_attn_func",
    "block_sparse_attn_backward",
    "block_index_from_flex",
    "sparse_spec",
    "sparse_patterns",
]
__version__ = "0.1.0"

_last = threading.local()


def last_backend() -> str | None:
    """Which backend ("cpu" or "cuda") ran this thread's last call ("torch" where the zigzag
    extract/scatter of a CUDA tensor fell back to torch's index ops: no CUDA backend there)."""
    return getattr(_last, "name", None)


def backend_status() -> dict:
    """{'cuda_compiled', 'cuda_available', 'reason', 'devices'}; never raises for a missing GPU."""
    return _core.backend_status()


def devices() -> list:
    """CUDA devices: index, name, compute_capability, total/free memory, sm_count, cubecl_ok."""
    return backend_status()["devices"]


_SPECS = {}  # validated specs of recent call shapes (the hot path skips re-validation)
_SPECS_MAX = 512


def _cache_key(x):
    """Hashable form of a cu_seqlens argument, or None where only the slow path can tell."""
    if isinstance(x, np.ndarray) and x.dtype == np.int32 and x.ndim == 1:
        return x.tobytes()
    return None


def varlen_spec(q_shape, k_shape, dtype, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                softmax_scale=None, causal=False, v_shape=None, window_size=(-1, -1)):
    """A validated spec for the varlen layout (shapes only; no data needed)."""
    causal = _flag(causal, "causal")
    window = _window(window_size)
    kq, kk = _cache_key(cu_seqlens_q), _cache_key(cu_seqlens_k)
    key = None
    if kq is not None and kk is not None and type(max_seqlen_q) is int and type(max_seqlen_k) is int \
            and (softmax_scale is None or type(softmax_scale) is float):
        key = (tuple(q_shape), tuple(k_shape), None if v_shape is None else tuple(v_shape), dtype, kq, kk,
               max_seqlen_q, max_seqlen_k, softmax_scale, causal, window)
        spec = _SPECS.get(key)
        if spec is not None:
            return spec
    spec = _varlen_spec(q_shape, k_shape, dtype, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        softmax_scale, causal, v_shape, window)
    if key is not None:
        if len(_SPECS) >= _SPECS_MAX:
            _SPECS.clear()
        _SPECS[key] = spec
    return spec


def _shape(x, name):
    """A tensor shape given by the caller: a sequence of non-negative ints (ValueError naming the
    argument otherwise, instead of the bare OverflowError of a negative size)."""
    try:
        dims = [int(n) for n in x]
    except (TypeError, ValueError):
        raise TypeError(f"invalid argument `{name}`: expected a sequence of ints, got {x!r}") from None
    if any(n < 0 or n >= 2 ** 62 for n in dims) or any(isinstance(n, (bool, float)) for n in x):
        raise ValueError(f"invalid argument `{name}`: sizes must be non-negative ints, got {tuple(x)}")
    return dims


def _varlen_spec(q_shape, k_shape, dtype, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 softmax_scale, causal, v_shape, window):
    return _core.varlen_spec(_shape(q_shape, "q_shape"), _shape(k_shape, "k_shape"),
                             _shape(k_shape if v_shape is None else v_shape, "v_shape"), dtype,
                             int32_vector(cu_seqlens_q, "cu_seqlens_q"),
                             int32_vector(cu_seqlens_k, "cu_seqlens_k"),
                             _count(max_seqlen_q, "max_seqlen_q"), _count(max_seqlen_k, "max_seqlen_k"),
                             _scale(softmax_scale), causal, window)


def grouped_spec(q_shape, k_shape, dtype, q_ranges, kv_ranges, softmax_scale=None, causal=True, v_shape=None,
                 window_size=(-1, -1), kv_block_table=None):
    """A validated spec for grouped attention (shapes only). kv_block_table: see
    grouped_flash_attn_func."""
    causal = _flag(causal, "causal")
    window = _window(window_size)
    table = None if kv_block_table is None else int32_vector(kv_block_table, "kv_block_table")
    return _core.grouped_spec(_shape(q_shape, "q_shape"), _shape(k_shape, "k_shape"),
                              _shape(k_shape if v_shape is None else v_shape, "v_shape"), dtype,
                              int32_ranges(q_ranges, "q_ranges"), int32_ranges(kv_ranges, "kv_ranges"),
                              _scale(softmax_scale), causal, window, table)


def _count(x, name):
    """A non-negative int: Python / numpy ints and 0-d integer arrays or torch tensors (flash-attn
    users pass ``cu_seqlens.diff().max()``); bools and everything else raise."""
    if _is_torch(x) or isinstance(x, np.ndarray):
        kind = str(x.dtype)
        if getattr(x, "ndim", None) != 0 or not (kind.startswith(("int", "uint", "torch.int", "torch.uint"))):
            raise ValueError(f"invalid argument `{name}`: expected a non-negative int or a 0-d integer tensor, "
                            f"got {type(x).__name__} of shape {tuple(x.shape)} and dtype {x.dtype}")
        x = int(x.item())
    elif isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise ValueError(f"invalid argument `{name}`: expected a non-negative int, got {x!r}")
    if x < 0 or x >= 2 ** 63:
        raise ValueError(f"invalid argument `{name}`: expected a non-negative int, got {x!r}")
    return int(x)


def _flag(x, name):
    """A bool: Python bool, numpy bool_ or a 0-d torch bool tensor; anything else (a string, an int)
    is a TypeError, so that `causal='no'` cannot silently mean True."""
    if x is False or x is True:  # the common case first: this runs several times per call
        return x
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if _is_torch(x) and str(getattr(x, "dtype", "")) == "torch.bool" and getattr(x, "ndim", None) == 0:
        return bool(x.item())
    if isinstance(x, np.ndarray) and x.dtype == np.bool_ and x.ndim == 0:
        return bool(x)
    raise TypeError(f"invalid argument `{name}`: expected a bool, got {type(x).__name__} {x!r}")


def _window(w):
    """flash-attn's window_size (left, right) -> a pair of ints (-1 = unbounded; values are
    checked once, in Rust, naming `window_size`)."""
    if w == (-1, -1) and type(w) is tuple:
        return -1, -1
    if isinstance(w, (tuple, list)) and len(w) == 2 and all(
            isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)) for x in w):
        left, right = int(w[0]), int(w[1])
        if not all(-2 ** 62 < x < 2 ** 62 for x in (left, right)):
            raise ValueError(f"invalid argument `window_size`: {tuple(w)} is out of range")
        return left, right
    raise TypeError(f"invalid argument `window_size`: expected a pair of ints (left, right), -1 = unbounded, "
                    f"got {w!r}")


def _zero_option(x, name):
    """dropout_p / softcap: a number that must be 0 (flash-attn's \"off\"); others are not implemented."""
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(f"invalid argument `{name}`: expected a float, got {type(x).__name__}")
    if x != 0:
        raise NotImplementedError(f"`{name}`={x!r} is not implemented by cubeattn (only {name}=0.0)")


def _unsupported(dropout_p=0.0, softcap=0.0, alibi_slopes=None):
    """flash-attn options cubeattn has no kernel for: their defaults pass, anything else raises
    NotImplementedError naming the argument."""
    if dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None \
            and type(dropout_p) in (float, int) and type(softcap) in (float, int):
        return
    _zero_option(dropout_p, "dropout_p")
    _zero_option(softcap, "softcap")
    if alibi_slopes is not None:
        raise NotImplementedError("`alibi_slopes` is not implemented by cubeattn (only alibi_slopes=None)")


def _results(out, lse, return_lse, return_attn_probs):
    """flash-attn's return convention: out, or (out, softmax_lse, S_dmask) with return_attn_probs
    (S_dmask is always None here: cubeattn never materialises the attention matrix); our extra
    return_lse=True gives (out, lse)."""
    if return_attn_probs:
        return out, lse, None
    if return_lse:
        return out, lse
    return out


def _scale(s):
    if s is None:
        return None
    if isinstance(s, bool) or not isinstance(s, (int, float, np.floating, np.integer)):
        raise TypeError(f"invalid argument `softmax_scale`: expected a float or None, got {type(s).__name__}")
    return float(s)


def _check_device(device):
    if not isinstance(device, str):
        raise TypeError(f"invalid argument `device`: expected 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return device


def _device_for(device, *conv):
    """`device` as the core takes it: 'auto' / 'cuda' with a torch CUDA input become 'auto:N' /
    'cuda:N' for that tensor's device N, so each torchrun rank computes on its own GPU."""
    device = _check_device(device)
    if device in ("auto", "cuda", "gpu"):
        for c in conv:
            t = c.torch_like
            if t is not None and t.is_cuda:
                kind = "auto" if device == "auto" else "cuda"
                return f"{kind}:{t.device.index or 0}"
    return device


def _note_cpu_run(dev, name, spec, backward=False, deterministic=False):
    """`device="auto"` with CUDA inputs (`dev` "auto:N") whose call the core ran on the CPU backend
    (`name`): a RuntimeWarning naming why CUDA refused it (head_dim, dtype, size), shown once per
    reason and call site, so that a slow host run is never silent."""
    if name == "cpu" and dev.startswith("auto:"):
        why = _core.cuda_refusal(spec, backward, bool(deterministic), dev)
        if why:
            warnings.warn(f"cubeattn ran CUDA tensors on the CPU backend: {why} (device='cuda' raises instead)",
                          RuntimeWarning, stacklevel=4)


def _needs_grad(q, k, v) -> bool:
    if not any(_is_torch(x) for x in (q, k, v)):
        return False
    from ._autograd import needs_grad

    return needs_grad(q, k, v)


def _traced(x) -> bool:
    """Whether `x` is a torch tensor under tracing (torch.compile's Dynamo, fake or functional
    tensors of AOTAutograd / export): such calls go through the custom ops of `_ops`, whose fake
    implementations give the output shapes. Plain eager tensors take the direct path."""
    if not _is_torch(x):
        return False
    import torch

    return torch.compiler.is_compiling() or type(x) is not torch.Tensor


def _out_shape(q_shape, v_shape):
    """out's shape: q's with v's head_dim last (v may have its own head_dim, as DeepSeek's MLA
    with q, k 192 and v 128)."""
    return tuple(q_shape[:-1]) + (v_shape[-1],)


def _check_like_q(cq, named, shapes=(), out_shape=None):
    """dtype of each (name, Converted) must be q's (TypeError), and the shapes of those named in
    `shapes` `out_shape` (ValueError): the core sees bytes only, so a float16 / bfloat16 mix or a
    reshaped `out` with the same element count would otherwise be read as garbage."""
    for name, c in named:
        if c.dtype != cq.dtype:
            raise TypeError(f"invalid dtype for `{name}`: {c.dtype}; q is {cq.dtype} (they must match)")
        if name in shapes and tuple(c.shape) != tuple(out_shape):
            raise ValueError(f"invalid argument `{name}`: shape {tuple(c.shape)} differs from out's {tuple(out_shape)} "
                             f"(q's with v's head_dim)")


def _forward(spec, q, k, v, cq, ck, cv, return_lse, deterministic, device):
    """The forward of a validated spec (any key set: dense, paged, block-sparse): through autograd
    when a torch input requires grad."""
    _check_like_q(cq, (("k", ck), ("v", cv)))
    if _needs_grad(q, k, v):
        from ._autograd import attention

        if spec.qk_int8 is not None:
            raise ValueError("invalid argument `quant_gran`: the INT8 QK^T option (qk_int8) is forward-only; run it "
                             "under torch.no_grad() or with inputs that do not require grad")

        return attention(spec, q, k, v, (cq, ck, cv), return_lse, deterministic, device)
    return _run_forward(spec, cq, ck, cv, return_lse, device)


def _one_gpu(device, *conv):
    """The torch device when every input is a CUDA tensor on the GPU `device` resolves to, else
    None (then the host path runs; CUBEATTN_TORCH_HOST_COPY=1 forces it, for comparisons)."""
    if not hasattr(_core, "forward_device") or any(c.device_tensor is None for c in conv):
        return None
    if os.environ.get("CUBEATTN_TORCH_HOST_COPY") == "1":
        return None
    gpu = conv[0].device_tensor.device
    if any(c.device_tensor.device != gpu for c in conv) or not device.endswith(f":{gpu.index or 0}"):
        return None
    return gpu


_WS = {}  # workspace bytes per (spec, device, direction); a spec object lives in _SPECS


def _raw_stream(torch, gpu):
    """torch's current stream of `gpu` as a CUstream address (the raw getter torch's own
    extensions use: a fraction of `torch.cuda.current_stream`'s cost)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(gpu.index if gpu.index is not None else torch.cuda.current_device())
    return torch.cuda.current_stream(gpu).cuda_stream


def _workspace(spec, gpu, dev, backward=False, deterministic=False, kv_counts=False):
    """(stream, workspace tensor, bytes) for a device-resident call on torch's current stream of
    `gpu`, or None where the host path must run; `kv_counts`: for `_core.forward_device_kv` (the
    kvcache path with the key counts on the device, whose plan differs). The workspace comes from
    torch's caching allocator, so torch's memory statistics include it and it is reused."""
    import torch

    stream = _raw_stream(torch, gpu)
    key = (id(spec), dev, backward, deterministic, kv_counts)
    hit = _WS.get(key)
    if hit is not None and hit[0] is spec:
        n = hit[1]
    else:
        if kv_counts:
            n = _core.forward_kv_workspace(spec, dev, stream)
        else:
            n = _core.device_workspace(spec, dev, stream, backward, deterministic)
        if n is None:
            return None
        if len(_WS) >= 4 * _SPECS_MAX:
            _WS.clear()
        _WS[key] = (spec, n)
    ws = torch.empty(n, dtype=torch.uint8, device=gpu) if n else None  # kept alive by the caller
    return stream, ws, n


def _forward_on_gpu(torch, spec, gpu, dev, q, k, v, out_shape, return_lse):
    """The device-resident forward of contiguous CUDA tensors q, k, v: enqueued on torch's current
    stream, no copies, no synchronization. None where the host path must run."""
    w = _workspace(spec, gpu, dev)
    if w is None:
        return None
    return _enqueue_forward(torch, spec, gpu, dev, w, q, k, v, out_shape, return_lse)


def _new_outputs(torch, spec, gpu, dtype, out_shape):
    """Uninitialised out (`out_shape`, `dtype`) and lse ([heads_q, total_q] float32) on `gpu`, for
    a device-resident forward of `spec` to write."""
    total_q, _, heads_q, _, _ = spec.dims
    return (torch.empty(out_shape, dtype=dtype, device=gpu),
            torch.empty((heads_q, total_q), dtype=torch.float32, device=gpu))


def _enqueue_forward(torch, spec, gpu, dev, w, q, k, v, out_shape, return_lse):
    """`_forward_on_gpu` once its workspace `w` (`_workspace`'s triple) is at hand."""
    stream, ws, n = w
    o, lse = _new_outputs(torch, spec, gpu, q.dtype, out_shape)
    if not _core.forward_device(spec, q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(),
                                (ws.data_ptr() if ws is not None else 0), n, stream, dev):
        o.zero_()
        lse.fill_(float("inf"))
    _last.name = "cuda"
    return (o, lse) if return_lse else o


def _run_forward(spec, cq, ck, cv, return_lse, device):
    dev = _device_for(device, cq, ck, cv)
    total_q, _, heads_q, _, _ = spec.dims
    gpu = _one_gpu(dev, cq, ck, cv)
    if gpu is not None:
        import torch

        res = _forward_on_gpu(torch, spec, gpu, dev, cq.device_tensor, ck.device_tensor, cv.device_tensor,
                              _out_shape(cq.shape, cv.shape), return_lse)
        if res is not None:
            return res
    out, lse, name = _core.forward(spec, cq.bytes, ck.bytes, cv.bytes, dev)
    _last.name = name
    _note_cpu_run(dev, name, spec)
    o = from_core(out, _out_shape(cq.shape, cv.shape), cq.dtype, cq)
    if not return_lse:
        return o
    return o, from_core(lse, (heads_q, total_q), "float32", cq)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, return_lse=False,
                           device="auto", q_descale=None, k_descale=None, v_descale=None):
    """Attention over a packed batch: sequence b has queries cu_seqlens_q[b]:cu_seqlens_q[b+1] and
    keys cu_seqlens_k[b]:cu_seqlens_k[b+1]. flash-attn 2's signature and argument order; causal is
    bottom-right aligned; window_size=(left, right) is sliding-window attention (-1 = unbounded).
    dropout_p, softcap and alibi_slopes must keep their defaults (NotImplementedError otherwise).
    block_table ([batch, max_blocks_per_seq] int32) reads a paged k, v [num_blocks,
    page_block_size, heads_kv, head_dim] as flash-attn does: sequence b's keys 0 ..
    cu_seqlens_k[b+1] - cu_seqlens_k[b] lie in the blocks block_table[b] lists (see _kvcache.py).
    Returns out; (out, softmax_lse, None) with return_attn_probs (no S_dmask is ever built);
    (out, lse) with the keyword-only return_lse. `deterministic` applies to the autograd
    backward of torch inputs that require grad. FP8 inputs (q, k, v torch.float8_e4m3fn, forward
    only; keyword-only float32 descales [batch, heads_kv], FlashAttention-3's interface; with a
    block_table the paged rows are gathered first): see _fp8.py; the output is bfloat16."""
    if _fp8.wanted(q, k, v, q_descale, k_descale, v_descale):
        if block_table is not None:
            # the paged rows gathered in sequence order, then dequantised as packed ones
            from ._kvcache import gather_paged

            k, v = gather_paged(k, v, cu_seqlens_k, block_table)
            block_table = None
        q, k, v = _fp8.dequantize(q, k, v, q_descale, k_descale, v_descale, cu_seqlens_q, cu_seqlens_k)
    if _traced(q):
        from . import _ops

        return _ops.call_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                           softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                           return_attn_probs, block_table, return_lse, device)
    _unsupported(dropout_p, softcap, alibi_slopes)
    deterministic, return_attn_probs = _flag(deterministic, "deterministic"), _flag(return_attn_probs, "return_attn_probs")
    return_lse = _flag(return_lse, "return_lse")
    if block_table is not None:
        from ._kvcache import paged_varlen

        res = paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, softmax_scale,
                           causal, window_size, return_lse or return_attn_probs, deterministic, device)
    else:
        cq, ck, cv = to_core(q, "q"), to_core(k, "k"), to_core(v, "v")
        spec = varlen_spec(cq.shape, ck.shape, cq.dtype, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale, causal, v_shape=cv.shape, window_size=window_size)
        res = _forward(spec, q, k, v, cq, ck, cv, return_lse or return_attn_probs, deterministic, device)
    if not (return_lse or return_attn_probs):
        return res
    return _results(res[0], res[1], return_lse, return_attn_probs)


_CU = {}  # cu_seqlens of batched calls per (batch, seqlen)


def _cu(b, s):
    a = _CU.get((b, s))
    if a is None:
        if len(_CU) > 256:
            _CU.clear()
        a = _CU[(b, s)] = np.arange(b + 1, dtype=np.int32) * np.int32(s)
        a.setflags(write=False)
    return a


def _batched_dims(q, k, v):
    """(batch, seqlen_q, seqlen_k) of the batched layout, checked (rank 4, one batch size)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(x.shape) != 4:
            raise ValueError(f"invalid argument `{name}`: expected rank 4 [batch, seqlen, heads, head_dim], got shape {tuple(x.shape)}")
    b = q.shape[0]
    for name, x in (("k", k), ("v", v)):
        if x.shape[0] != b:
            raise ValueError(f"invalid argument `{name}`: batch {x.shape[0]} differs from q's batch {b}")
    return b, q.shape[1], k.shape[1]


def _batched_to_varlen(q, k, v):
    b, sq, sk = _batched_dims(q, k, v)
    flat = [x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]) for x in (q, k, v)]
    return flat, _cu(b, sq), _cu(b, sk), b, sq, sk


_FAST = {}  # batched torch CUDA calls already validated: call key -> (spec, dev, gpu)


def _fast_key(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
              return_attn_probs, return_lse, device):
    """The key of a batched call whose every argument is hashable by value and at its default
    where that matters, or None (then the validating path runs)."""
    if not (type(causal) is bool and type(deterministic) is bool
            and (softmax_scale is None or type(softmax_scale) is float)
            and type(window_size) is tuple and return_attn_probs is False and return_lse is False
            and dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None and type(device) is str
            and type(dropout_p) in (float, int) and type(softcap) in (float, int)):
        return None
    try:
        return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, softmax_scale,
                causal, window_size, device)
    except AttributeError:  # not torch tensors
        return None


def _fast_forward(key, q, k, v, deterministic, device):
    """A repeat of a batched torch CUDA forward the validating path has run before (same shapes,
    dtypes, devices and options; contiguous): enqueued with the cached spec, without the layers of
    the general path; through autograd (`_autograd.attention_on_gpu`) when an input requires grad.
    None where the general path must run."""
    hit = _FAST.get(key)
    if hit is None or not all(is_dense_cuda(x) for x in (q, k, v)):
        return None
    import torch

    spec, dev, gpu = hit
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        w = _workspace(spec, gpu, dev)
        if w is None:
            return None
        from ._autograd import attention_on_gpu

        return attention_on_gpu(spec, gpu, dev, w, q, k, v, deterministic, device)
    return _forward_on_gpu(torch, spec, gpu, dev, q, k, v, _out_shape(q.shape, v.shape), False)


def _remember_fast(key, spec, conv, device):
    """Records a batched call of contiguous tensors that the device path serves, for
    `_fast_forward` (`conv`: q, k, v converted by `to_core`)."""
    if _last.name != "cuda" or not all(c.torch_like.is_contiguous() for c in conv):
        return
    dev = _device_for(device, *conv)
    gpu = _one_gpu(dev, *conv)
    if gpu is None:
        return
    if len(_FAST) >= _SPECS_MAX:
        _FAST.clear()
    _FAST[key] = (spec, dev, gpu)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, return_lse=False,
                    device="auto", q_descale=None, k_descale=None, v_descale=None):
    """Batched layout q [batch, seqlen_q, heads_q, d], k/v [batch, seqlen_k, heads_kv, d], with
    flash-attn 2's signature and argument order (see flash_attn_varlen_func). Returns out
    [batch, seqlen_q, heads_q, d]; with return_lse (out, lse [batch, heads_q, seqlen_q]); with
    return_attn_probs (out, lse, None). FP8 inputs with descales: as flash_attn_varlen_func."""
    if _fp8.wanted(q, k, v, q_descale, k_descale, v_descale):
        q, k, v = _fp8.dequantize(q, k, v, q_descale, k_descale, v_descale)
    if _traced(q):
        from . import _ops

        return _ops.call_dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                    deterministic, return_attn_probs, return_lse, device)
    key = _fast_key(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                    return_attn_probs, return_lse, device)
    if key is not None:
        out = _fast_forward(key, q, k, v, deterministic, device)
        if out is not None:
            return out
    _unsupported(dropout_p, softcap, alibi_slopes)
    want_lse = _flag(return_lse, "return_lse")
    probs = _flag(return_attn_probs, "return_attn_probs")
    (fq, fk, fv), cu_q, cu_k, b, sq, sk = _batched_to_varlen(q, k, v)
    res = flash_attn_varlen_func(fq, fk, fv, cu_q, cu_k, sq, sk, 0.0, softmax_scale, causal, window_size,
                                 deterministic=deterministic, return_lse=want_lse or probs, device=device)
    if not (want_lse or probs):
        if key is not None and _is_torch(res) and res.is_cuda:
            conv = to_core(fq, "q"), to_core(fk, "k"), to_core(fv, "v")
            spec = varlen_spec(conv[0].shape, conv[1].shape, conv[0].dtype, cu_q, cu_k, sq, sk, softmax_scale, causal,
                               v_shape=conv[2].shape, window_size=window_size)
            _remember_fast(key, spec, conv, device)
        return res.reshape(_out_shape(q.shape, v.shape))
    o, lse = res
    return _results(o.reshape(_out_shape(q.shape, v.shape)), _lse_batched(lse, b, sq), want_lse, probs)


def _lse_batched(lse, b, sq):
    """lse of the varlen layout [heads, b * sq] -> the batched layout's [b, heads, sq] (numpy or torch)."""
    lse = lse.reshape(lse.shape[0], b, sq)
    return lse.permute(1, 0, 2) if hasattr(lse, "permute") else lse.transpose(1, 0, 2)


def _backward_on_gpu(spec, gpu, conv, lse, deterministic, dev):
    """dq, dk, dv computed on device-resident torch tensors, or None where the host path must run."""
    import torch

    cq, ck, cv, co, cg = conv
    if not (_is_torch(lse) and lse.is_cuda and lse.device == gpu and lse.dtype == torch.float32):
        return None
    # (out and dout were checked by `_run_backward`)
    total_q, _, heads_q, _, _ = spec.dims
    lt = dense_cuda(lse.detach())
    if lt.numel() != heads_q * total_q:
        raise ValueError(f"invalid argument `lse`: expected {heads_q * total_q} values, got {lt.numel()}")
    w = _workspace(spec, gpu, dev, True, bool(deterministic))
    if w is None:
        return None
    stream, ws, n = w
    ptrs = [c.device_tensor.data_ptr() for c in (cq, ck, cv, co)] + [lt.data_ptr(), cg.device_tensor.data_ptr()]
    grads = tuple(torch.empty(c.shape, dtype=c.device_tensor.dtype, device=gpu) for c in (cq, ck, cv))
    if not _core.backward_device(spec, *ptrs, *(g.data_ptr() for g in grads), (ws.data_ptr() if ws is not None else 0), n, stream,
                                 bool(deterministic), dev):
        for g in grads:
            g.zero_()
    return grads


def _backward_device_fast(spec, gpu, dev, q, k, v, out, lse, dout, deterministic):
    """Autograd's backward after a forward that ran on the device path: q, k, v, out and lse are
    the contiguous CUDA tensors that forward used (validated then); only dout is checked here.
    None where the general path must run (dout on another device or of another dtype or shape)."""
    import torch

    if not (isinstance(dout, torch.Tensor) and dout.device == gpu and dout.dtype == out.dtype
            and dout.shape == out.shape):
        return None
    d = dense_cuda(dout)
    w = _workspace(spec, gpu, dev, True, bool(deterministic))
    if w is None:
        return None
    stream, ws, n = w
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if not _core.backward_device(spec, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                                 d.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), (ws.data_ptr() if ws is not None else 0), n,
                                 stream, bool(deterministic), dev):
        for g in (dq, dk, dv):
            g.zero_()
    _last.name = "cuda"
    return dq, dk, dv


def _run_backward(spec, dout, q, k, v, out, lse, deterministic, device):
    cq, ck, cv = to_core(q, "q"), to_core(k, "k"), to_core(v, "v")
    co, cg = to_core(out, "out"), to_core(dout, "dout")
    _check_like_q(cq, (("k", ck), ("v", cv), ("out", co), ("dout", cg)), shapes=("out", "dout"),
                  out_shape=_out_shape(cq.shape, cv.shape))
    dev = _device_for(device, cq, ck, cv)
    gpu = _one_gpu(dev, cq, ck, cv, co, cg)
    if gpu is not None:
        grads = _backward_on_gpu(spec, gpu, (cq, ck, cv, co, cg), lse, deterministic, dev)
        if grads is not None:
            _last.name = "cuda"
            return grads
    if _is_torch(lse):
        lse = lse.detach().cpu().numpy()
    lse_arr = np.ascontiguousarray(np.asarray(lse, dtype=np.float32)).reshape(-1)
    dq, dk, dv, name = _core.backward(spec, cq.bytes, ck.bytes, cv.bytes, co.bytes, lse_arr, cg.bytes,
                                      bool(deterministic), dev)
    _last.name = name
    _note_cpu_run(dev, name, spec, backward=True, deterministic=deterministic)
    return (from_core(dq, cq.shape, cq.dtype, cq), from_core(dk, ck.shape, ck.dtype, ck),
            from_core(dv, cv.shape, cv.dtype, cv))


def flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, *, device="auto"):
    """Gradients (dq, dk, dv) of flash_attn_varlen_func given dout, its out and lse. After the
    tensors, the options follow flash-attn's order (dropout_p, softmax_scale, causal, window_size,
    softcap, alibi_slopes, deterministic); they must be those of the forward."""
    if _traced(q):
        from . import _ops

        return _ops.call_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                                         alibi_slopes, deterministic, device)
    _unsupported(dropout_p, softcap, alibi_slopes)
    deterministic = _flag(deterministic, "deterministic")
    dt = dtype_name(q, "q")
    spec = varlen_spec(tuple(q.shape), tuple(k.shape), dt, cu_seqlens_q, cu_seqlens_k,
                       max_seqlen_q, max_seqlen_k, softmax_scale, causal, v_shape=tuple(v.shape),
                       window_size=window_size)
    return _run_backward(spec, dout, q, k, v, out, lse, deterministic, device)


def grouped_flash_attn_func(q, k, v, q_ranges, kv_ranges, dropout_p=0.0, softmax_scale=None, causal=True,
                            window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                            return_attn_probs=False, *, return_lse=False, kv_block_table=None, device="auto"):
    """Grouped attention in one launch: group g's query rows q_ranges[g] = [start, end) attend to keys
    kv_ranges[g] = [start, end) of the shared k, v (key ranges may overlap). Causal (and a
    window_size) is bottom-right inside each group: the group's last query row sees up to
    kv_ranges[g][1]. Rows in no group get zero output and lse +inf. After the ranges, the options
    follow flash-attn's order and return convention (see flash_attn_varlen_func).

    kv_block_table (int32 [total_k / 64], keyword): a paged k, v. Keys are numbered in logical
    order (kv_ranges and the causal masks speak of it); logical block g (keys 64 g .. 64 g + 63) is
    stored at rows 64 * kv_block_table[g] .. + 63 of k and v, and its gradient is written there in
    dk, dv. The table must be a permutation of range(total_k / 64), total_k a multiple of 64,
    every key range must start at a multiple of 64, and window_size must be (-1, -1) (ValueError
    naming the argument otherwise). The zigzag layer reads its all-gathered K,V this way."""
    if _traced(q):
        from . import _ops

        return _ops.call_grouped(q, k, v, q_ranges, kv_ranges, dropout_p, softmax_scale, causal, window_size,
                                            softcap, alibi_slopes, deterministic, return_attn_probs, return_lse,
                                            kv_block_table, device)
    _unsupported(dropout_p, softcap, alibi_slopes)
    deterministic, probs = _flag(deterministic, "deterministic"), _flag(return_attn_probs, "return_attn_probs")
    want_lse = _flag(return_lse, "return_lse")
    cq, ck, cv = to_core(q, "q"), to_core(k, "k"), to_core(v, "v")
    spec = grouped_spec(cq.shape, ck.shape, cq.dtype, q_ranges, kv_ranges, softmax_scale, causal, v_shape=cv.shape,
                        window_size=window_size, kv_block_table=kv_block_table)
    res = _forward(spec, q, k, v, cq, ck, cv, want_lse or probs, deterministic, device)
    if not (want_lse or probs):
        return res
    return _results(res[0], res[1], want_lse, probs)


def grouped_flash_attn_backward(dout, q, k, v, out, lse, q_ranges, kv_ranges, dropout_p=0.0, softmax_scale=None,
                                causal=True, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                deterministic=False, *, kv_block_table=None, device="auto"):
    """Gradients (dq, dk, dv) of grouped_flash_attn_func; dk/dv accumulate over overlapping groups
    (with a kv_block_table: dk, dv in k's paged layout)."""
    if _traced(q):
        from . import _ops

        return _ops.call_grouped_backward(dout, q, k, v, out, lse, q_ranges, kv_ranges, dropout_p, softmax_scale,
                                          causal, window_size, softcap, alibi_slopes, deterministic, kv_block_table,
                                          device)
    _unsupported(dropout_p, softcap, alibi_slopes)
    deterministic = _flag(deterministic, "deterministic")
    dt = dtype_name(q, "q")
    spec = grouped_spec(tuple(q.shape), tuple(k.shape), dt, q_ranges, kv_ranges, softmax_scale, causal,
                        v_shape=tuple(v.shape), window_size=window_size, kv_block_table=kv_block_table)
    return _run_backward(spec, dout, q, k, v, out, lse, deterministic, device)


def estimate_vram(q_shape, k_shape, dtype="bfloat16", cu_seqlens_q=None, cu_seqlens_k=None, q_ranges=None,
                  kv_ranges=None, causal=False, backward=False, deterministic=False, *, v_shape=None) -> dict:
    """Bytes the CUDA backend needs for a call with these shapes: inputs, outputs, lse, workspace, total.
    Give cu_seqlens (varlen) or q_ranges/kv_ranges (grouped); neither means one sequence. v_shape:
    v's shape where its head_dim is not k's (k's shape otherwise)."""
    q_shape, k_shape = _shape(q_shape, "q_shape"), _shape(k_shape, "k_shape")
    v_shape = k_shape if v_shape is None else _shape(v_shape, "v_shape")
    for name, shp in (("q_shape", q_shape), ("k_shape", k_shape), ("v_shape", v_shape)):
        if len(shp) != 3:
            raise ValueError(f"invalid argument `{name}`: expected [total_tokens, heads, head_dim], got {tuple(shp)}")
    if q_ranges is not None:
        spec = grouped_spec(q_shape, k_shape, dtype, q_ranges, kv_ranges, None, causal, v_shape=v_shape)
    else:
        if cu_seqlens_q is None:
            cu_seqlens_q = [0, q_shape[0]]
            cu_seqlens_k = [0, k_shape[0]]
        cq = int32_vector(cu_seqlens_q, "cu_seqlens_q")
        ck = int32_vector(cu_seqlens_k, "cu_seqlens_k")
        # a malformed cu_seqlens is reported by the spec under its own name, not as a bad maximum
        mq = max(0, int(np.diff(cq).max())) if cq.size > 1 else 0
        mk = max(0, int(np.diff(ck).max())) if ck.size > 1 else 0
        spec = varlen_spec(q_shape, k_shape, dtype, cq, ck, mq, mk, None, causal, v_shape=v_shape)
    return _core.estimate_vram(spec, _flag(backward, "backward"), _flag(deterministic, "deterministic"))


def warmup(head_dims=(64, 128), dtypes=("bfloat16", "float16"), causal=(True, False), backward=True,
           device="cuda", progress=True):
    """Compiles (or loads from the kernel cache) the CUDA kernels a job will use, ahead of its first
    call: one small call per (dtype, head_dim, causal) that takes every kernel of that variant
    (split-K combine and the uncovered-row fill included), forward and, with `backward`, backward.
    Compiled kernels are cached on disk (``CUBEATTN_CACHE_DIR``; ``off`` disables), so a later
    process starts without compiling. Returns the number of variants warmed."""
    import sys

    todo = [(dt, hd, c) for dt in dtypes for hd in head_dims for c in causal]
    rng = np.random.default_rng(0)
    for i, (dt, hd, c) in enumerate(todo):
        if progress:
            print(f"cubeattn.warmup [{i + 1}/{len(todo)}] {dt} head_dim={hd} causal={c}", file=sys.stderr, flush=True)
        npdt = {"float32": np.float32, "float16": np.float16}.get(dt)
        if npdt is None:
            from ._arrays import BF16 as npdt
        q = rng.uniform(-1, 1, (40, 2, hd)).astype(npdt)
        k = rng.uniform(-1, 1, (640, 1, hd)).astype(npdt)
        v = rng.uniform(-1, 1, (640, 1, hd)).astype(npdt)
        # rows 36..39 lie in no group (the uncovered-row kernels run); 640 keys on a small grid
        # make the plan split the key range (the split-K combine runs)
        qr, kr = [[0, 20], [20, 36]], [[0, 640], [64, 600]]
        out, lse = grouped_flash_attn_func(q, k, v, qr, kr, causal=bool(c), return_lse=True, device=device)
        if backward:
            grouped_flash_attn_backward(q, q, k, v, out, lse, qr, kr, causal=bool(c), device=device)
    return len(todo)


# flash-attn's inference surface: a KV cache appended in place, paged caches (python/cubeattn/_kvcache.py)
from ._kvcache import flash_attn_with_kvcache  # noqa: E402

# zigzag llama3 context parallelism (torch.distributed; torch is imported on first use only)
from .zigzag import (extract_zigzag_kv_slice, scatter_grad_to_zigzag, zigzag_cu_seqlens,  # noqa: E402
                     zigzag_llama3_flash_attn_varlen_func, zigzag_merge, zigzag_split)

__all__ += ["zigzag_llama3_flash_attn_varlen_func", "zigzag_split", "zigzag_merge", "zigzag_cu_seqlens",
            "extract_zigzag_kv_slice", "scatter_grad_to_zigzag"]

# block-sparse attention (python/cubeattn/_sparse.py; patterns in sparse_patterns.py)
from . import sparse_patterns  # noqa: E402
from ._sparse import block_index_from_flex, block_sparse_attn_backward, block_sparse_attn_func, sparse_spec  # noqa: E402

# dense attention with SageAttention-style INT8 Q K^T, on the block-sparse path (python/cubeattn/_sage.py)
from ._sage import sageattn  # noqa: E402

__all__ += ["sageattn"]
