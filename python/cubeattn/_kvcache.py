"""flash-attn's inference surface on top of the grouped call: `flash_attn_with_kvcache` (a KV cache
appended in place, cache_batch_idx, cache_leftpad, paged caches through block_table) and the
paged `block_table` of `flash_attn_varlen_func`. Each batch row becomes one group of the grouped
call (its query rows against its key range of the cache, bottom-right causal inside the group).

Paged K,V: when the pages hold a multiple of 64 keys, the used pages are distinct, every key range
starts at a page boundary and no window is set, the cache is read in place through the grouped
call's `kv_block_table` (64-key blocks: the logical order lists each row's blocks, then the unused
ones); otherwise the keys of each row are gathered into a contiguous buffer first (exact, one
copy of the visited keys). The host reads cache_seqlens, block_table, cache_batch_idx and
cache_leftpad to build the call (a device sync when they are CUDA tensors), except on the plain
path with an int32 CUDA cache_seqlens, whose counts stay on the device (see `_device_counts_call`).
No maths here.
"""
from __future__ import annotations

import os

import numpy as np

from ._arrays import _asarray, _is_torch, dense_cuda, dtype_name, int32_vector, is_dense_cuda, to_core

PAGE = 64  # keys per block of the grouped call's kv_block_table (the core's KV_PAGE)


def _per_row(x, batch, name, default):
    """An int or a 1-D integer array of `batch` non-negative values, as int64 numpy."""
    if x is None:
        return np.full(batch, default, np.int64)
    if isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)):
        a = np.full(batch, int(x), np.int64)
    else:
        a = int32_vector(x, name).astype(np.int64)
        if a.shape[0] != batch:
            raise ValueError(f"invalid argument `{name}`: expected {batch} values (one per batch row), got {a.shape[0]}")
    if a.size and a.min() < 0:
        raise ValueError(f"invalid argument `{name}`: values must be non-negative, got {a.min()}")
    return a


def _table(block_table, batch):
    t = _asarray(block_table, "block_table")
    if t.ndim != 2 or t.shape[0] != batch:
        raise ValueError(f"invalid argument `block_table`: expected shape [{batch}, max_blocks_per_seq], got {t.shape}")
    if t.dtype.kind not in "iu":
        raise TypeError(f"invalid dtype for `block_table`: {t.dtype}; expected int32")
    return t.astype(np.int64)


def _rank4(x, name):
    if len(x.shape) != 4:
        raise ValueError(f"invalid argument `{name}`: expected rank 4, got shape {tuple(x.shape)}")


def _index(x, idx):
    """`idx` (numpy ints) as an index for `x` (a torch tensor on x's device, or numpy)."""
    if _is_torch(x):
        import torch

        return torch.as_tensor(idx, device=x.device)
    return idx


def _flat(x):
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def paged_keys(block_table, page, starts, ends, num_pages, paged_ok):
    """Where each row's keys [starts[b], ends[b]) of a paged cache (pages of `page` keys, `num_pages`
    of them) lie: (kv_ranges, kv_block_table, None) for the in-place read, or (kv_ranges, None,
    rows) where `rows` are the flat cache rows to gather (kv_ranges then index the gathered
    buffer). `paged_ok`: the caller allows the in-place read (no window)."""
    batch, max_blocks = block_table.shape
    need = -(-ends // page)
    short = np.nonzero(need > max_blocks)[0]
    if short.size:
        b = short[0]
        raise ValueError(f"invalid argument `block_table`: row {b} holds {max_blocks} blocks of {page} keys; "
                         f"its {ends[b]} keys need {need[b]}")
    visited = np.arange(max_blocks)[None, :] < need[:, None]
    bad = np.nonzero(visited & ((block_table < 0) | (block_table >= num_pages)))[0]
    if bad.size:
        raise ValueError(f"invalid argument `block_table`: row {bad[0]} names a block outside 0..{num_pages}")
    used = block_table[visited]  # row by row, in logical order
    in_place = (paged_ok and page % PAGE == 0 and np.all(starts % PAGE == 0)
                and np.unique(used).size == used.size)
    if in_place:
        sub = page // PAGE
        logical = (used[:, None] * sub + np.arange(sub)).reshape(-1)
        rest = np.setdiff1d(np.arange(num_pages * sub), logical, assume_unique=True)
        first = (np.cumsum(need) - need) * page
        ranges = np.stack([first + starts, first + ends], axis=1)
        return ranges.astype(np.int32), np.concatenate([logical, rest]).astype(np.int32), None
    lens = ends - starts
    first = np.cumsum(lens) - lens
    row = np.repeat(np.arange(batch), lens)
    t = np.arange(lens.sum()) - np.repeat(first, lens) + np.repeat(starts, lens)  # position in its row
    ranges = np.stack([first, first + lens], axis=1)
    return ranges.astype(np.int32), None, block_table[row, t // page] * page + t % page


def _grouped(q_flat, k_flat, v_flat, q_ranges, kv_ranges, table, rows, softmax_scale, causal, window_size, lse,
             deterministic, device):
    from . import grouped_flash_attn_func

    if rows is not None:
        idx = _index(k_flat, rows)
        k_flat, v_flat = k_flat[idx], v_flat[idx]
    return grouped_flash_attn_func(q_flat, k_flat, v_flat, q_ranges, kv_ranges, 0.0, softmax_scale, causal,
                                   window_size, deterministic=deterministic, return_lse=lse, kv_block_table=table,
                                   device=device)


def _paged_shapes(k, v):
    for name, x in (("k", k), ("v", v)):
        if len(x.shape) != 4:
            raise ValueError(f"invalid argument `{name}`: with a block_table, expected [num_blocks, page_block_size, "
                             f"heads_kv, head_dim], got shape {tuple(x.shape)}")


def _key_lens(ck):
    """The sequences' key counts from cu_seqlens_k (int32, at least one entry, from 0, not decreasing)."""
    lens_k = np.diff(ck.astype(np.int64))
    if ck.size < 1 or (lens_k.size and (lens_k.min() < 0 or ck[0] != 0)):
        raise ValueError("invalid argument `cu_seqlens_k`: must start at 0 and not decrease")
    return lens_k


def paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, softmax_scale, causal,
                 window_size, return_lse, deterministic, device):
    """flash_attn_varlen_func with a paged k, v [num_blocks, page_block_size, heads_kv, d]: sequence
    b's keys 0 .. cu_seqlens_k[b+1] - cu_seqlens_k[b] are read through block_table[b]. Returns
    out, or (out, lse [heads_q, total_q]); differentiable as the grouped call is (dk, dv in the
    paged layout)."""
    from . import _count, _window

    _paged_shapes(k, v)
    cq, ck = int32_vector(cu_seqlens_q, "cu_seqlens_q"), int32_vector(cu_seqlens_k, "cu_seqlens_k")
    if cq.shape != ck.shape or cq.size < 1:
        raise ValueError(f"invalid argument `cu_seqlens_k`: {ck.size} entries, cu_seqlens_q has {cq.size}")
    lens_k = _key_lens(ck)
    batch = cq.size - 1
    if _count(max_seqlen_k, "max_seqlen_k") < (lens_k.max() if batch else 0):
        raise ValueError(f"invalid argument `max_seqlen_k`: smaller than the longest sequence ({lens_k.max()})")
    _count(max_seqlen_q, "max_seqlen_q")  # the grouped spec checks the query ranges themselves
    table = _table(block_table, batch)
    paged_ok = _window(window_size) == (-1, -1)
    ranges, kv_table, rows = paged_keys(table, k.shape[1], np.zeros(batch, np.int64), lens_k, k.shape[0], paged_ok)
    q_ranges = np.stack([cq[:-1], cq[1:]], axis=1)
    return _grouped(q, _flat(k), _flat(v), q_ranges, ranges, kv_table, rows, softmax_scale, causal, window_size,
                    return_lse, deterministic, device)


def gather_paged(k, v, cu_seqlens_k, block_table):
    """k, v of a paged cache [num_blocks, page_block_size, heads_kv, d] as packed rows [total_k,
    heads_kv, d] in sequence order (sequence b's keys 0 .. cu_seqlens_k[b+1] - cu_seqlens_k[b] read
    through block_table[b]), any dtype: the FP8 path dequantises these with each sequence's descale
    (a block two sequences share may then carry two scales)."""
    _paged_shapes(k, v)
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(f"invalid argument `v`: shape {tuple(v.shape)} does not page like k's {tuple(k.shape)}")
    ck = int32_vector(cu_seqlens_k, "cu_seqlens_k")
    lens_k = _key_lens(ck)
    batch = ck.size - 1
    table = _table(block_table, batch)
    _, _, rows = paged_keys(table, k.shape[1], np.zeros(batch, np.int64), lens_k, k.shape[0], False)
    idx = _index(k, rows)
    return _flat(k)[idx], _flat(v)[idx]


def _append(k_cache, v_cache, k, v, lead, positions, page):
    """Writes new keys/values k, v [batch, seqlen_new, heads_kv, d] into the caches in place: row b's
    token i at cache position positions[b, i] of cache row lead[b] (non-paged, page None), or of
    the paged cache through lead = block_table (page = page_block_size)."""
    n = k.shape[1]
    if page is None:
        i0 = np.repeat(lead, n)
        i1 = positions.reshape(-1)
    else:
        t = positions
        i0 = np.take_along_axis(lead, t // page, axis=1).reshape(-1)
        i1 = (t % page).reshape(-1)
    both, idx, at = np.stack([i0, i1]), None, None
    for cache, new in ((k_cache, k), (v_cache, v)):
        # the indices go to a cache's device once (one copy for both caches on one GPU)
        where = cache.device if _is_torch(cache) else None
        if idx is None or where != at:
            idx, at = _index(cache, both), where
        vals = _flat(new)
        if _is_torch(cache):
            import torch

            with torch.no_grad():
                cache[idx[0], idx[1]] = vals.to(cache.device)
        else:
            cache[idx[0], idx[1]] = vals


# ------------------------------------------------------------------ the plain call, fast
# A call without cache_batch_idx, cache_leftpad, block_table or rotary embedding whose shapes,
# dtypes, devices and options the validating path (`_general`) has served before skips its
# layers: each row's keys are 0 .. cache_seqlens[b] + seqlen_new of cache row b, so the ranges
# follow from those counts alone, the spec comes from a cache keyed by them, and CUDA tensors go
# straight to the device-resident forward (as flash_attn_func's repeats do). The first call of
# each shape takes the validating path, which raises what it raises; anything the fast path
# cannot tell at once (a cache_seqlens of another type, a value out of range, a spec the core
# refuses) goes there too, so errors and results are the validating path's.

FAST = True  # False: every call takes the validating path (the tests compare the two)
_SEEN = {}  # call key -> (device for the core, torch GPU of a device-resident call or None, dtype name)
_DSPEC = {}  # (call key, each row's key count) -> spec
_QR = {}  # (batch, seqlen_q) -> q_ranges (read-only)
_MAX = 512
_pkg = None


def _api():
    """The cubeattn package (its helpers and `_core`, looked up at call time so that monkeypatches hold)."""
    global _pkg
    if _pkg is None:
        import importlib

        _pkg = importlib.import_module(__package__)
    return _pkg


def _desc(x):
    """What the fast path keys an array on: its type, shape, dtype and (torch) device."""
    if type(x) is np.ndarray:
        return np.ndarray, x.shape, x.dtype
    if _is_torch(x):
        return type(x), x.shape, x.dtype, x.device
    raise TypeError


def _plain_key(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table,
               softmax_scale, causal, window_size, softcap, alibi_slopes, num_splits, return_softmax_lse, device):
    """The key of a plain call (see above) whose options are plain values, or None."""
    if not (FAST and rotary_cos is None and rotary_sin is None and cache_batch_idx is None and cache_leftpad is None
            and block_table is None and alibi_slopes is None and type(causal) is bool
            and type(return_softmax_lse) is bool and type(device) is str
            and (softmax_scale is None or type(softmax_scale) is float)
            and type(softcap) in (float, int) and softcap == 0 and type(num_splits) is int and num_splits >= 0
            and type(window_size) is tuple and len(window_size) == 2
            and type(window_size[0]) is int and type(window_size[1]) is int):
        return None
    try:
        new = None if k is None and v is None else (_desc(k), _desc(v))
        return _desc(q), _desc(k_cache), _desc(v_cache), new, softmax_scale, causal, window_size, \
            return_softmax_lse, device
    except (TypeError, AttributeError):  # not numpy arrays / torch tensors: the validating path says so
        return None


def _remember(key, q, k_cache, v_cache, device):
    """Records a plain call the validating path served: the device string the core gets and the
    GPU of a device-resident call, as `_device_for` / `_one_gpu` decide them."""
    api = _api()
    conv = [to_core(x, name) for x, name in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache"))]
    dev = api._device_for(device, *conv)
    gpu = api._one_gpu(dev, *conv)
    if len(_SEEN) >= _MAX:
        _SEEN.clear()
    _SEEN[key] = (dev, gpu, dtype_name(q, "q"))


def _row_ends(cache_seqlens, batch, n_new, width):
    """(each row's key count after the append, the one cache_seqlens of every row or None) of a
    plain call, or None where the validating path must look (it raises for bad values)."""
    s = cache_seqlens
    room = width - n_new
    if s is None:
        return None if n_new else ((width,) * batch, None)
    if type(s) is int:
        return ((s + n_new,) * batch, s) if 0 <= s <= room else None
    if type(s) is np.ndarray:
        if s.ndim != 1 or s.dtype.kind not in "iu" or s.shape[0] != batch:
            return None
    elif _is_torch(s):
        import torch

        if s.dtype not in (torch.int32, torch.int64) or s.ndim != 1 or s.shape[0] != batch:
            return None
    else:
        return None
    vals = s.tolist()  # a CUDA tensor: a device sync, as on the validating path
    if vals and (min(vals) < 0 or max(vals) > room or max(vals) >= 2 ** 31):
        return None
    uniform = vals[0] if vals and vals.count(vals[0]) == batch else None
    return tuple(x + n_new for x in vals), uniform


def _plain_spec(q, k_cache, v_cache, ends, dt, softmax_scale, causal, window_size):
    """The grouped spec of a plain call (the validating path's, for the same ranges), or None
    where the core refuses it."""
    api = _api()
    batch, sq, width = q.shape[0], q.shape[1], k_cache.shape[1]
    qr = _QR.get((batch, sq))
    if qr is None:
        if len(_QR) >= _MAX:
            _QR.clear()
        qr = _QR[(batch, sq)] = np.stack([np.arange(batch) * sq, np.arange(1, batch + 1) * sq], axis=1).astype(np.int32)
        qr.setflags(write=False)
    kr = np.empty((batch, 2), np.int32)
    kr[:, 0] = np.arange(batch) * width
    kr[:, 1] = kr[:, 0] + np.array(ends, np.int64)
    try:
        return api._core.grouped_spec([batch * sq, q.shape[2], q.shape[3]],
                                      [k_cache.shape[0] * width, k_cache.shape[2], k_cache.shape[3]],
                                      [v_cache.shape[0] * v_cache.shape[1], v_cache.shape[2], v_cache.shape[3]], dt,
                                      qr, kr, api._scale(softmax_scale), causal, api._window(window_size), None)
    except Exception:  # noqa: BLE001 - the validating path raises it, naming the argument
        return None


def _cached_spec(key, ends, q, k_cache, v_cache, dt, softmax_scale, causal, window_size):
    """`_plain_spec` of a plain call with each row's key count `ends` (None: full cache rows),
    cached by (call key, ends), or None where the core refuses it."""
    skey = (key, ends)
    spec = _DSPEC.get(skey)
    if spec is None:
        width = k_cache.shape[1]
        spec = _plain_spec(q, k_cache, v_cache, (width,) * q.shape[0] if ends is None else ends, dt, softmax_scale,
                           causal, window_size)
        if spec is None:
            return None
        if len(_DSPEC) >= _MAX:
            _DSPEC.clear()
        _DSPEC[skey] = spec
    return spec


def _plain_call(seen, key, q, k_cache, v_cache, k, v, cache_seqlens, softmax_scale, causal, window_size, want_lse,
                device):
    """A plain call whose shapes the validating path has served (`seen`: `_SEEN`'s entry), or
    None (nothing done: the validating path runs)."""
    batch, n_new = q.shape[0], 0 if k is None else k.shape[1]
    dev, gpu, dt = seen
    if gpu is not None and _is_torch(cache_seqlens):
        res = _device_counts_call(seen, key, q, k_cache, v_cache, k, v, cache_seqlens, softmax_scale, causal,
                                  window_size, want_lse)
        if res is not None:
            return res
    row = _row_ends(cache_seqlens, batch, n_new, k_cache.shape[1])
    if row is None:
        return None
    ends, uniform = row
    spec = _cached_spec(key, ends, q, k_cache, v_cache, dt, softmax_scale, causal, window_size)
    if spec is None:
        return None
    api = _api()
    if n_new:
        if uniform is not None:  # every row's new keys at the same positions: one slice per cache
            for cache, x in ((k_cache, k), (v_cache, v)):
                if _is_torch(cache):
                    import torch

                    with torch.no_grad():
                        cache[:batch, uniform:uniform + n_new] = x.to(cache.device)
                else:
                    cache[:batch, uniform:uniform + n_new] = x
        else:
            seqlens = np.array(ends, np.int64) - n_new
            _append(k_cache, v_cache, k, v, np.arange(batch), seqlens[:, None] + np.arange(n_new), None)
    res = None
    if gpu is not None and os.environ.get("CUBEATTN_TORCH_HOST_COPY") != "1" \
            and is_dense_cuda(q) and is_dense_cuda(k_cache) and is_dense_cuda(v_cache):
        import torch

        # the kernels read q, k_cache, v_cache in place; out is allocated in q's shape
        res = api._forward_on_gpu(torch, spec, gpu, dev, q, k_cache, v_cache, q.shape, want_lse)
    if res is None:  # (to_core detaches torch inputs: no autograd graph, as on the validating path)
        res = api._run_forward(spec, to_core(_flat(q), "q"), to_core(_flat(k_cache), "k"),
                               to_core(_flat(v_cache), "v"), want_lse, device)
        res = (res[0].reshape(q.shape), res[1]) if want_lse else res.reshape(q.shape)
    return _result(res, q, want_lse)


def _result(res, q, want_lse):
    """out, or (out, lse [batch, heads_q, seqlen_q]) from the core's lse [heads_q, total_q]."""
    if not want_lse:
        return res
    out, lse = res
    lse = lse.reshape(q.shape[2], q.shape[0], q.shape[1])
    return out, lse.permute(1, 0, 2) if hasattr(lse, "permute") else lse.transpose(1, 0, 2)


# ------------------------------------------------------------------ key counts on the device
# A plain call whose cache_seqlens is an int32 CUDA tensor (flash-attn's usual decode loop) runs
# without reading it on the host: the spec is the call over full cache rows, and the core's
# `forward_device_kv` appends k, v at each row's count and runs the forward with those counts, all
# enqueued on torch's current stream (no synchronization, so a decode step can be captured in a
# CUDA graph). A count the cache cannot hold (negative, or more than seqlen_cache - seqlen_new)
# cannot raise without a synchronization: that row is left unwritten and its out and lse are NaN.
# Its plan covers whole rows whatever the window (`_core.forward_kv_workspace` sizes its
# workspace). Calls the core does not serve this way (other GPUs than sm_90, more than 32 query
# rows x GQA heads a sequence, paged caches) read the counts on the host as before.

_NO_DEVICE = set()  # call keys the core's device-count path does not serve


def _no_device(key):
    """Records a call key the device-count path does not serve."""
    if len(_NO_DEVICE) >= _MAX:
        _NO_DEVICE.clear()
    _NO_DEVICE.add(key)


def _device_counts_call(seen, key, q, k_cache, v_cache, k, v, counts, softmax_scale, causal, window_size, want_lse):
    """A plain call (see above) with its key counts on the device, or None (nothing done)."""
    import torch

    dev, gpu, dt = seen
    batch, width = q.shape[0], k_cache.shape[1]
    n_new = 0 if k is None else k.shape[1]
    if (key in _NO_DEVICE or os.environ.get("CUBEATTN_TORCH_HOST_COPY") == "1" or counts.dtype != torch.int32
            or counts.ndim != 1 or counts.shape[0] != batch or counts.device != q.device
            or not (counts.is_contiguous() and is_dense_cuda(q) and is_dense_cuda(k_cache) and is_dense_cuda(v_cache))):
        return None
    if n_new:
        if k.device != q.device or v.device != q.device or k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
            return None
        k, v = dense_cuda(k), dense_cuda(v)
    # the spec over full cache rows (cached under ends None)
    spec = _cached_spec(key, None, q, k_cache, v_cache, dt, softmax_scale, causal, window_size)
    if spec is None:
        return None
    api = _api()
    w = api._workspace(spec, gpu, dev, kv_counts=True)
    if w is None:
        _no_device(key)
        return None
    stream, ws, nbytes = w
    out, lse = api._new_outputs(torch, spec, gpu, q.dtype, q.shape)
    done = api._core.forward_device_kv(spec, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                                       lse.data_ptr(), ws.data_ptr() if ws is not None else 0, nbytes, stream, dev,
                                       counts.data_ptr(), k.data_ptr() if n_new else 0, v.data_ptr() if n_new else 0,
                                       n_new, width)
    if done is None:
        _no_device(key)
        return None
    api._last.name = "cuda"
    return _result((out, lse) if want_lse else out, q, want_lse)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False, *, device="auto"):
    """flash-attn's decoding call. q [batch, seqlen_q, heads_q, d]; k_cache, v_cache [batch_cache,
    seqlen_cache, heads_kv, d], or with block_table ([batch, max_blocks_per_seq] int32) a paged
    cache [num_blocks, page_block_size, heads_kv, d]. cache_seqlens (an int or [batch]): keys
    already in each row's cache; k, v [batch, seqlen_new, heads_kv, d], when given, are written
    into the caches in place at cache_seqlens .. + seqlen_new, and attention then runs over the
    updated cache. Row b attends to cache positions cache_leftpad[b] .. cache_seqlens[b] +
    seqlen_new of cache row cache_batch_idx[b] (default b); causal and window_size are
    bottom-right aligned on those keys. Returns out [batch, seqlen_q, heads_q, d]; with
    return_softmax_lse (out, lse [batch, heads_q, seqlen_q]). Inference only (no autograd, as
    flash-attn). rotary_cos / rotary_sin, softcap and alibi_slopes raise NotImplementedError;
    num_splits is a hint flash-attn's kernel takes and ours plans for itself (accepted, unused).
    An int32 CUDA cache_seqlens is read on the device where the kernels allow it (sm_90, at most 32
    query rows x GQA heads a sequence, no cache_batch_idx / cache_leftpad / block_table, after a
    first call of the same shapes): no synchronization, so the step can be captured in a CUDA
    graph; a row whose count does not fit (negative, or above seqlen_cache - seqlen_new) is then
    not appended to and its out and lse are NaN. Elsewhere the counts are read on the host and
    such a value raises ValueError."""
    if _api()._traced(q):  # in-place cache writes and host-built calls: run eagerly (a graph break)
        import torch

        return torch.compiler.disable(flash_attn_with_kvcache)(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
            return_softmax_lse, device=device)
    key = _plain_key(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table,
                     softmax_scale, causal, window_size, softcap, alibi_slopes, num_splits, return_softmax_lse, device)
    if key is not None:
        seen = _SEEN.get(key)
        if seen is not None:
            res = _plain_call(seen, key, q, k_cache, v_cache, k, v, cache_seqlens, softmax_scale, causal, window_size,
                              return_softmax_lse, device)
            if res is not None:
                return res
    res = _general(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                   block_table, softmax_scale, causal, window_size, softcap, alibi_slopes, num_splits,
                   return_softmax_lse, device)
    if key is not None and key not in _SEEN:
        _remember(key, q, k_cache, v_cache, device)
    return res


def _general(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
             block_table, softmax_scale, causal, window_size, softcap, alibi_slopes, num_splits, return_softmax_lse,
             device):
    """flash_attn_with_kvcache's validating path: every argument checked (errors name it), any
    combination of the options."""
    from . import _flag, _unsupported, _window

    _unsupported(0.0, softcap, alibi_slopes)
    for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if x is not None:
            raise NotImplementedError(f"`{name}` (rotary embedding inside the call) is not implemented by cubeattn: "
                                      f"rotate q and k before the call")
    if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)) or num_splits < 0:
        raise ValueError(f"invalid argument `num_splits`: expected an int >= 0, got {num_splits!r}")
    want_lse = _flag(return_softmax_lse, "return_softmax_lse")
    causal = _flag(causal, "causal")
    window = _window(window_size)
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _rank4(x, name)
    if tuple(k_cache.shape) != tuple(v_cache.shape):
        raise ValueError(f"invalid argument `v_cache`: shape {tuple(v_cache.shape)} differs from k_cache's "
                         f"{tuple(k_cache.shape)}")
    if (k is None) != (v is None):
        raise ValueError("invalid argument `v`: k and v are given together (both or neither)")
    batch, sq = q.shape[0], q.shape[1]
    n_new = 0
    if k is not None:
        for name, x in (("k", k), ("v", v)):
            _rank4(x, name)
            if x.shape[0] != batch or tuple(x.shape[2:]) != tuple(k_cache.shape[2:]):
                raise ValueError(f"invalid argument `{name}`: expected [{batch}, seqlen_new, "
                                 f"{', '.join(map(str, k_cache.shape[2:]))}], got {tuple(x.shape)}")
            if dtype_name(x, name) != dtype_name(k_cache, "k_cache"):
                raise TypeError(f"invalid dtype for `{name}`: {x.dtype}; k_cache is {k_cache.dtype}")
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"invalid argument `v`: seqlen_new {v.shape[1]} differs from k's {k.shape[1]}")
        if cache_seqlens is None:
            raise ValueError("invalid argument `cache_seqlens`: needed to append k, v (where each row's cache ends)")
        n_new = k.shape[1]
    # paged: [num_blocks, page_block_size, ...]; else [batch_cache, seqlen_cache, ...]
    rows_cache, width = k_cache.shape[0], k_cache.shape[1]
    if block_table is not None:
        if cache_batch_idx is not None:
            raise ValueError("invalid argument `cache_batch_idx`: not supported with a paged cache (block_table)")
        if cache_seqlens is None:
            raise ValueError("invalid argument `cache_seqlens`: needed with a paged cache (block_table)")
        lead = _table(block_table, batch)
        capacity = lead.shape[1] * width
    else:
        capacity = width
        if cache_batch_idx is None:
            lead = np.arange(batch, dtype=np.int64)
        else:
            lead = _per_row(cache_batch_idx, batch, "cache_batch_idx", 0)
            if lead.size and lead.max() >= rows_cache:
                raise ValueError(f"invalid argument `cache_batch_idx`: {lead.max()} is outside the cache's "
                                 f"{rows_cache} rows")
    seqlens = _per_row(cache_seqlens, batch, "cache_seqlens", capacity)
    starts = _per_row(cache_leftpad, batch, "cache_leftpad", 0)
    ends = seqlens + n_new
    if ends.size and ends.max() > capacity:
        b = int(np.argmax(ends))
        room = f"the {capacity} keys block_table's rows of {lead.shape[1]} blocks of {width} hold" \
            if block_table is not None else f"the cache's {capacity}"
        raise ValueError(f"invalid argument `cache_seqlens`: row {b} holds {seqlens[b]} keys plus {n_new} new, more "
                         f"than {room}")
    if np.any(starts > seqlens):
        raise ValueError("invalid argument `cache_leftpad`: larger than cache_seqlens")
    paged = block_table is not None
    q_ranges = np.stack([np.arange(batch) * sq, np.arange(1, batch + 1) * sq], axis=1).astype(np.int32)
    if paged:  # (checks the table before anything is written through it)
        kv_ranges, kv_table, rows = paged_keys(lead, width, starts, ends, rows_cache, window == (-1, -1))
    else:
        kv_ranges, kv_table, rows = np.stack([lead * width + starts, lead * width + ends], axis=1).astype(np.int32), \
            None, None
    if n_new:
        _append(k_cache, v_cache, k, v, lead, seqlens[:, None] + np.arange(n_new), width if paged else None)
    if _is_torch(q):  # inference only, as flash-attn's: no autograd graph through the cache
        q, k_cache, v_cache = q.detach(), k_cache.detach(), v_cache.detach()
    res = _grouped(_flat(q), _flat(k_cache), _flat(v_cache), q_ranges, kv_ranges, kv_table, rows, softmax_scale,
                   causal, window, want_lse, False, device)
    if not want_lse:
        return res.reshape(q.shape)
    out, lse = res
    lse = lse.reshape(q.shape[2], batch, sq)
    lse = lse.permute(1, 0, 2) if hasattr(lse, "permute") else lse.transpose(1, 0, 2)
    return out.reshape(q.shape), lse
