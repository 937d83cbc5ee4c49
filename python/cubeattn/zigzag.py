"""Zigzag llama3 context parallelism over torch.distributed, on top of the grouped call.

Layout. A packed varlen batch (``cu_seqlens`` of the full sequences, of any lengths) is spread over
the W ranks of a process group: every sequence is cut into 2W chunks in order and rank r keeps
chunks r and 2W-1-r of every sequence, back to back (``zigzag_split``; its local cu_seqlens are
``zigzag_cu_seqlens(cu_seqlens, W, r)``). Under causal attention the two chunks cost (r+1) +
(2W-r) chunk pairs together, the same on every rank: the work is balanced.

Any sequence lengths: uneven chunks. A sequence of L = 2W q + m tokens (0 <= m < 2W) is cut into
chunks of q + 1 tokens (the first m) and q tokens (the others); where every L is a multiple of 2W
the chunks are equal and every rank's local cu_seqlens are ``cu_seqlens / W``. This was chosen
over padding each sequence to a multiple of 2W: the shards hold real tokens only (no padding token
passes through the model; split and merge are plain permutations), the ranks' token counts differ
by at most one per sequence, and their attention work stays balanced for short documents too
(13 tokens on W = 2: padded to 16, chunks 4, 4, 4, 1 give the ranks 23 and 68 (query, key) pairs;
uneven chunks 4, 3, 3, 3 give 46 and 45), while every attention group stays exact: its keys are
real tokens in sequence order, so nothing is masked away. The only padding is in the collective
buffers (collectives move equal blocks): each rank's K,V are padded at the end to the longest
shard (at most one row per sequence more than its own) before the all-gather; those rows are
never read as keys, and their rows of the reduce-scattered gradient are dropped. Since the ranks'
local cu_seqlens do not determine the full lengths, the layer is given the full ones
(``full_cu_seqlens``; without it every full length must be a multiple of 2W and the full
cu_seqlens are the local ones times W).

Forward, per slice of ``heads_k_stride`` kv heads:

1. all-gather the local K and V of the slice. The gathered buffers are rank-major, as
   ``all_gather_into_tensor`` writes them:
   ``[rank 0: seq0 (c0, c2W-1), seq1 (c0, c2W-1), ..., rank 1: seq0 (c1, c2W-2), ...]``;
2. ONE ``grouped_flash_attn_func`` call for all sequences: per (sequence b, local chunk j) a
   group whose queries are the local chunk (positions [s_j, e_j) of sequence b) and whose keys are
   the keys of sequence b its rows can see, in sequence order: causally ``[0, e_j)``, causal inside
   each group measured from the group's end (bottom-right), so the mask is exact.

Sliding window (``window_size = (left, right)``, flash-attn's convention: position p sees keys
p - left .. p + right of its sequence, -1 = unbounded side; causal caps the right side at 0). The
groups' key ranges are cut to what their rows can see: causally ``[max(0, s_j - left), e_j)``,
so a rank skips every gathered key block no local row can see, and the window is passed through to
the grouped call (bottom-right inside each group: the group's end e_j is its last row's position,
so the window is exact). Without causal, a group's keys ``[max(0, s_j - left), min(L, e_j +
right))`` end ``d = min(right, L - e_j)`` keys after its last row (all of the rest, ``L - e_j``,
for right = -1), which shifts the bottom-right diagonal by d: that group is computed with the
window ``(left + d, right - d)`` (-1 stays -1), the same keys per row. Groups of equal window go to
one grouped call; rows that are in no group of a call get zero output there (lse +inf), so the
calls' outputs add up and their lse is the minimum (usually two calls: interior chunks, and the
chunks at a sequence's end). Only keys a local row needs are put in the key buffer.

In place (every chunk a multiple of 64 keys and no window: the usual case of full lengths that are
multiples of 128W). The grouped call reads the gathered K, V where they lie: its
``kv_block_table`` says where each 64-key block of the sequence order sits in the gathered buffer
(the kernels translate a key tile's rows once per tile; masks and ranges stay in sequence order),
and the backward writes dK, dV at those rows, which is the layout the reduce-scatter takes. No copy
of K, V or dK, dV is made (``heads_k_stride < heads_kv`` copies the local slice before its
all-gather, as any slice of a [tokens, heads, d] tensor must be). dK, dV are summed over the ranks
by a reduce-scatter in float32 (a cast-copy each); with two ranks on NCCL in their own 16-bit dtype
(no copy, half the bytes: the sum of two rounds once either way; ``CUBEATTN_ZIGZAG_RS_FLOAT32=1``
keeps float32).

Ordered copy (other chunk lengths, a window, or ``CUBEATTN_ZIGZAG_IN_PLACE=0``: the baseline the
in-place read is measured against). K and V are gathered together and the keys the local rows
need are put in sequence order by one ``index_select`` each; the backward scatters dK, dV back
(the inverse rows, zero elsewhere). These copies are O(T) against the O(T^2) attention: about 1%
of a step (docs/context-parallel.md).

Backward, per head slice: K,V are all-gathered again (not kept from the forward: that would hold W
times the local K,V per layer), one ``grouped_flash_attn_backward`` per call gives dQ (local, kept)
and dK,dV over the gathered keys; they are cast to float32 in the gathered layout and summed onto
their owners with ``reduce_scatter_tensor`` (NCCL). gloo has no reduce-scatter: there an
``all_reduce`` of the float32 buffer and the own slice give the same sum. dK,dV partial sums of the
W ranks are added in float32 and rounded to the input dtype once.

On CUDA the all-gather of slice i+1 (and in the backward the reduce-scatter of slice i) runs on a
separate communication stream, double-buffered, ordered against the compute stream with CUDA
events. The attention calls are stream-ordered (enqueued on the current stream, no host or device
synchronisation), so the collectives of one slice overlap the attention of another. On CPU tensors
(gloo) everything is synchronous.
"""
from __future__ import annotations

import os

import numpy as np

from . import _core
from ._arrays import _is_torch, dtype_name, from_core, int32_vector, to_core

__all__ = [
    "zigzag_llama3_flash_attn_varlen_func",
    "zigzag_split",
    "zigzag_merge",
    "zigzag_cu_seqlens",
    "extract_zigzag_kv_slice",
    "scatter_grad_to_zigzag",
]


# ---------------------------------------------------------------- argument checks

def _int(x, name, lo=0):
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"invalid argument `{name}`: expected an int, got {type(x).__name__}")
    if x < lo:
        raise ValueError(f"invalid argument `{name}`: must be >= {lo}, got {x}")
    return int(x)


def _cu(cu_seqlens, name="cu_seqlens"):
    a = int32_vector(cu_seqlens, name)
    if a.size == 0:
        raise ValueError(f"invalid argument `{name}`: needs batch + 1 values, got an empty array")
    return a


def _short(a, n=8):
    """An int array for a message: its values, the first n of a long one."""
    a = a.tolist()
    return str(a) if len(a) <= n else str(a[:n])[:-1] + f", ... ({len(a)} values)]"


def _rename(e, name):
    """Errors of the core name `cu_seqlens`; say which argument it was."""
    msg = str(e)
    if name != "cu_seqlens":
        msg = msg.replace("`cu_seqlens`", f"`{name}`")
    return type(e)(msg)


def _rows_tensor(rows, like):
    import torch

    return torch.from_numpy(rows).to(like.device)


def _take(x, rows, name):
    """x[rows] along axis 0 (torch index_select or numpy take); checks the row count."""
    n = x.shape[0]
    if rows.size and rows.max() >= n:
        raise ValueError(f"invalid argument `{name}`: has {n} rows but row {int(rows.max())} is needed")
    if _is_torch(x):
        return x.index_select(0, _rows_tensor(rows, x))
    return np.asarray(x)[rows]


# ---------------------------------------------------------------- layout helpers

def zigzag_cu_seqlens(cu_seqlens, world_size, rank=None):
    """cu_seqlens of rank ``rank``'s local shard: each sequence keeps 2 of its 2W chunks (chunks
    r and 2W-1-r). Sequences of any length; where one is not a multiple of 2 * world_size the
    ranks' shards differ, and ``rank`` is needed (ValueError naming `rank` without it, unless
    world_size is 1). Without a rank (every length a multiple of 2W) the local lengths are the full
    ones divided by W on every rank. Returns int32 of the same kind (numpy array or torch tensor)."""
    w = _int(world_size, "world_size", 1)
    r = None if rank is None else _rank(rank, w)
    if w == 1:  # one rank holds every sequence whole
        r = 0
    out = _core.zigzag_local_cu_seqlens(_cu(cu_seqlens), w, r)
    if _is_torch(cu_seqlens):
        import torch

        return torch.from_numpy(out).to(cu_seqlens.device)
    return out


def _rank(rank, w):
    r = _int(rank, "rank")
    if r >= w:
        raise ValueError(f"invalid argument `rank`: must be in 0..{w}, got {r}")
    return r


def zigzag_split(x, cu_seqlens, rank, world_size):
    """This rank's zigzag shard of a packed full batch ``x`` [total_tokens, ...]: per sequence,
    chunks ``rank`` and ``2W-1-rank`` of its 2W chunks, back to back (sequences of any length:
    the first L % 2W chunks of a sequence hold one token more than the others)."""
    w = _int(world_size, "world_size", 1)
    r = _rank(rank, w)
    cu = _cu(cu_seqlens)
    if x.shape[0] != cu[-1]:
        raise ValueError(f"invalid argument `x`: has {x.shape[0]} rows, cu_seqlens ends at {cu[-1]}")
    return _take(x, _core.zigzag_shard_rows(cu, w, r), "x")


def zigzag_merge(shards, cu_seqlens, world_size):
    """Inverse of ``zigzag_split``: the W shards (a list in rank order), their concatenation
    [total_tokens, ...], or the all-gathered buffer of shards each padded at the end to the longest
    (``all_gather_into_tensor``'s equal blocks; the same as the concatenation where every length is
    a multiple of 2W) back to the packed batch in original order."""
    w = _int(world_size, "world_size", 1)
    cu = _cu(cu_seqlens)
    total = int(cu[-1])
    if isinstance(shards, (list, tuple)):
        if len(shards) != w:
            raise ValueError(f"invalid argument `shards`: expected {w} shards (one per rank), got {len(shards)}")
        for r, x in enumerate(shards):
            n = int(_core.zigzag_local_cu_seqlens(cu, w, r)[-1])
            if _row_count(x, "shards") != n:
                raise ValueError(f"invalid argument `shards`: shard {r} has {x.shape[0]} rows, rank {r}'s shard of "
                                 f"cu_seqlens has {n}")
        if _is_torch(shards[0]):
            import torch

            gathered = torch.cat(list(shards), 0)
        else:
            gathered = np.concatenate([np.asarray(s) for s in shards], 0)
    else:
        gathered = shards
    n = _row_count(gathered, "shards")
    padded = w * _core.zigzag_rank_rows(cu, w)
    if n == padded:  # the gathered (padded) buffer
        return _take(gathered, _core.zigzag_gathered_rows(cu, w, 2 * w - 1), "shards")
    if n != total:
        raise ValueError(f"invalid argument `shards`: {n} rows in all; cu_seqlens ends at {total} "
                         f"(the gathered buffer of padded shards has {padded})")
    # the concatenation of unpadded shards: row i of it holds full-batch row `order[i]`
    order = np.concatenate([_core.zigzag_shard_rows(cu, w, r) for r in range(w)])
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size)
    return _take(gathered, inverse, "shards")


def _layout(cu_seqlens, world_size, max_chunk_idx):
    """(cu_seqlens int32, W, last chunk) of an extract/scatter call, the ints checked."""
    w = _int(world_size, "world_size", 1)
    cu = _cu(cu_seqlens)
    m = 2 * w - 1 if max_chunk_idx is None else _int(max_chunk_idx, "max_chunk_idx")
    return cu, w, m


_PREFIX_ROWS = {}  # rows of the extracted prefixes per (cu_seqlens bytes, W, last chunk)


def _prefix_rows(cu, w, m):
    """Rows of the extracted prefixes; the core checks the layout on first sight (its errors name
    `cu_seqlens`, `world_size` or `max_chunk_idx`)."""
    key = (cu.tobytes(), w, m)
    n = _PREFIX_ROWS.get(key)
    if n is None:
        n = len(_core.zigzag_gathered_rows(cu, w, m))
        if len(_PREFIX_ROWS) >= 256:
            _PREFIX_ROWS.clear()
        _PREFIX_ROWS[key] = n
    return n


def _row_count(x, name):
    if len(x.shape) == 0:
        raise ValueError(f"invalid argument `{name}`: expected [total_tokens, ...], got a 0-d array")
    return int(x.shape[0])


def _copy_on_gpu(x, name, cu, w, m, out_rows, scatter):
    """Extract (or scatter) of a CUDA tensor by the CubeCL kernel (kernels/zigzag_copy.rs),
    enqueued on torch's current stream: no host copy, no synchronization. None where this build
    has no CUDA backend or it cannot start on x's GPU (then torch's index ops copy)."""
    dtype_name(x, name)
    if not x.is_contiguous():
        raise ValueError(f"invalid argument `{name}`: a CUDA tensor must be contiguous (call .contiguous() first)")
    if not hasattr(_core, "zigzag_copy_device"):
        return None
    import torch

    from . import _raw_stream

    gpu = x.device
    index = gpu.index if gpu.index is not None else torch.cuda.current_device()
    out = torch.empty((out_rows,) + tuple(x.shape[1:]), dtype=x.dtype, device=gpu)
    row_bytes = int(np.prod(x.shape[1:], dtype=np.int64)) * x.element_size()
    if not _core.zigzag_copy_device(cu, w, m, x.data_ptr(), int(x.shape[0]), out.data_ptr(), out_rows, row_bytes,
                                    scatter, _raw_stream(torch, gpu), index):
        return None
    _mark("cuda")
    return out


def _mark(name):
    from . import _last

    _last.name = name


def extract_zigzag_kv_slice(kv, cu_seqlens, world_size, max_chunk_idx=None):
    """Gathered zigzag K or V [W * longest shard, heads, d] (the all-gather of every rank's shard,
    rank order, each padded at its end to the longest shard: [total_tokens, heads, d] where every
    length is a multiple of 2W) -> for each sequence its chunks 0..max_chunk_idx (default: all 2W)
    in original order, sequences concatenated. ``cu_seqlens`` are the full sequences'. An exact
    row copy (float32, float16, bfloat16: bit for bit): in the Rust core for numpy arrays and CPU
    tensors; for CUDA tensors (contiguous) a CubeCL kernel enqueued on torch's current stream
    (torch's ``index_select`` where no CUDA backend runs). The result does not track gradients
    (``scatter_grad_to_zigzag`` is the backward)."""
    cu, w, m = _layout(cu_seqlens, world_size, max_chunk_idx)
    n = _prefix_rows(cu, w, m)
    total = w * _core.zigzag_rank_rows(cu, w)
    if _row_count(kv, "kv") != total:
        raise ValueError(f"invalid argument `kv`: has {kv.shape[0]} rows, the gathered buffer of "
                         f"cu_seqlens has {total}")
    if _is_torch(kv) and kv.is_cuda:
        out = _copy_on_gpu(kv, "kv", cu, w, m, n, False)
        if out is not None:
            return out
        _mark("torch")
        return kv.detach().index_select(0, _rows_tensor(_core.zigzag_gathered_rows(cu, w, m), kv))
    rows = _core.zigzag_gathered_rows(cu, w, m)
    c = to_core(kv, "kv")
    row_bytes = int(np.prod(c.shape[1:], dtype=np.int64)) * {"float32": 4}.get(c.dtype, 2)
    out = _core.zigzag_extract(c.bytes, row_bytes, rows)
    _mark("cpu")
    return from_core(_as_core_dtype(out, c.dtype), (len(rows),) + tuple(c.shape[1:]), c.dtype, c)


def scatter_grad_to_zigzag(grad, cu_seqlens, world_size, max_chunk_idx=None):
    """Backward of ``extract_zigzag_kv_slice``: the gradient of the extracted prefixes back to
    the gathered zigzag layout [W * longest shard, heads, d]; rows outside the prefixes (padding
    included) are zero.
    Exact; same paths as ``extract_zigzag_kv_slice`` (on CUDA one kernel writes every row once,
    the zeros included)."""
    cu, w, m = _layout(cu_seqlens, world_size, max_chunk_idx)
    n = _prefix_rows(cu, w, m)
    total = w * _core.zigzag_rank_rows(cu, w)
    if _row_count(grad, "grad") != n:
        raise ValueError(f"invalid argument `grad`: has {grad.shape[0]} rows, the extracted prefixes "
                         f"have {n}")
    if _is_torch(grad) and grad.is_cuda:
        out = _copy_on_gpu(grad, "grad", cu, w, m, total, True)
        if out is not None:
            return out
        import torch

        _mark("torch")
        out = torch.zeros((total,) + tuple(grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        return out.index_copy_(0, _rows_tensor(_core.zigzag_gathered_rows(cu, w, m), grad), grad.detach())
    rows = _core.zigzag_gathered_rows(cu, w, m)
    c = to_core(grad, "grad")
    row_bytes = int(np.prod(c.shape[1:], dtype=np.int64)) * {"float32": 4}.get(c.dtype, 2)
    out = _core.zigzag_scatter(c.bytes, row_bytes, rows, total)
    _mark("cpu")
    return from_core(_as_core_dtype(out, c.dtype), (total,) + tuple(c.shape[1:]), c.dtype, c)


def _as_core_dtype(buf, dtype):
    """uint8 bytes from the core -> the flat float32 / uint16 array from_core expects."""
    return buf.view(np.float32 if dtype == "float32" else np.uint16)


# ---------------------------------------------------------------- the distributed layer

class _Plan:
    """Everything about one call that does not depend on the data: the grouped calls' ranges and
    windows, and the rows of the gathered buffer the keys come from.

    ``calls``: ``(q_ranges, kv_ranges, window)`` per grouped call (one, but for windows without
    causal: one per window, see the module docstring); empty where this rank holds no token. In
    place, ``kv_block_table`` is set and kv_ranges speak of the full batch's rows; else
    ``k_rows`` / ``v_rows`` are the rows of the gathered [W, K then V, block, ...] buffer that hold
    the keys the local rows need, in sequence order (kv_ranges index them)."""

    def __init__(self, full_cu, world_size, rank, causal, window=(-1, -1), in_place=True):
        w, r = world_size, rank
        parts = 2 * w
        cu32 = np.asarray(full_cu, np.int32)
        full = cu32.astype(np.int64)
        lens = np.diff(full)
        local = _core.zigzag_local_cu_seqlens(cu32, w, r).astype(np.int64)
        self.world_size, self.rank = w, r
        self.total_local = int(local[-1])
        self.block = int(_core.zigzag_rank_rows(cu32, w))  # rows of each rank in the gathered buffer
        left, right = window
        if causal:
            right = 0

        def chunk(j):  # (start, length) of chunk j of every sequence: zigzag::chunk in the Rust core
            q, m = lens // parts, lens % parts
            return j * q + np.minimum(j, m), q + (j < m)
        (sa, ca), (sb, cb) = chunk(r), chunk(parts - 1 - r)
        # groups, two per sequence (chunk r, chunk 2W-1-r): local rows, positions [s, e) in the sequence
        q0 = np.stack([local[:-1], local[:-1] + ca], 1).ravel()
        n = np.stack([ca, cb], 1).ravel()
        s = np.stack([sa, sb], 1).ravel()
        e = s + n
        seq_len, seq_start = np.repeat(lens, 2), np.repeat(full[:-1], 2)
        # the keys each group's rows see, [k0, k1) in the sequence, and the shift of the group's
        # diagonal (its keys end d after its last row) that the call's window takes back
        k0 = np.maximum(s - left, 0) if left >= 0 else np.zeros_like(s)
        if right >= 0:
            k1 = np.minimum(seq_len, e + right)
        else:
            k1 = seq_len
        d = k1 - e
        keep = n > 0
        if left < 0 and right < 0:  # no window: one call
            wins = np.zeros((len(s), 2), np.int64) - 1
        else:
            wins = np.stack([np.where(left >= 0, left + d, -1), np.where(right >= 0, right - d, -1)], 1)
            if causal:
                wins[:, 1] = -1  # causal caps the right side (d = 0)
        g_full = _core.zigzag_gathered_rows(cu32, w, 2 * w - 1)  # gathered row of each full-batch row
        m = self.block
        page = _core.KV_PAGE
        self.kv_block_table = self.k_rows = self.v_rows = None
        windowed = left >= 0 or (right >= 0 and not causal)
        total = int(full[-1])
        if in_place and total and not windowed and not (lens % (parts * page)).any():
            # In place (every chunk a multiple of the 64-key block, so every shard has `total / W`
            # rows and the gathered buffer is the full batch permuted): the kernels read the gathered
            # K, V through a block table (logical block j at gathered rows 64 t[j]..) and write dK,
            # dV in the gathered layout, which is what the reduce-scatter takes: no reorder copies.
            self.kv_block_table = (g_full[::page] // page).astype(np.int32)
            kv_lo, kv_hi = seq_start + k0, seq_start + k1
            self.covers = True
        else:
            # The ordered copy: the keys some local row needs (the union of the groups' key ranges),
            # in sequence order. K and V of a slice are gathered together, each rank contributing
            # [2, block, ...] (its shard padded), so gathered row g of K is at flat row
            # (g // block) * 2 * block + g % block (V: + block).
            lo, hi = (seq_start + k0)[keep], (seq_start + k1)[keep]
            cover = np.zeros(total + 1, np.int64)
            np.add.at(cover, lo, 1)
            np.add.at(cover, hi, -1)
            needed = np.cumsum(cover[:-1]) > 0
            before = np.concatenate([[0], np.cumsum(needed)])  # needed keys before each full-batch row
            g = g_full[np.nonzero(needed)[0]]
            flat_k = (g // m) * 2 * m + g % m if m else g
            self.k_rows, self.v_rows = flat_k, flat_k + m
            kv_lo, kv_hi = before[seq_start + k0], before[seq_start + k1]
            self.covers = bool(g.size == w * m)  # every gathered row is a key (no zero fill needed)
        self.calls = []
        for win in sorted({tuple(x) for x in wins[keep].tolist()}):
            sel = keep & (wins == win).all(1)
            qr = np.stack([q0[sel], q0[sel] + n[sel]], 1).astype(np.int32)
            kr = np.stack([kv_lo[sel], kv_hi[sel]], 1).astype(np.int32)
            self.calls.append((qr, kr, win))
        self._dev = {}

    def rows(self, device):
        """(k_rows, v_rows) of the ordered copy as int64 tensors on `device` (made once per device)."""
        import torch

        key = str(device)
        if key not in self._dev:
            self._dev[key] = (torch.from_numpy(self.k_rows).to(device), torch.from_numpy(self.v_rows).to(device))
        return self._dev[key]


_PLANS = {}  # _Plan per (full cu_seqlens bytes, W, rank, causal, window, in place)


def _plan_for(full_cu, world_size, rank, causal, window, in_place):
    """The cached _Plan of a call shape: its ranges, block table and (ordered copy) the row
    indices on the device are made once, not on every call."""
    key = (full_cu.tobytes(), world_size, rank, causal, window, in_place)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _Plan(full_cu, world_size, rank, causal, window, in_place)
        if len(_PLANS) >= 64:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def _backend(group):
    import torch.distributed as dist

    return dist.get_backend(group)


def _all_gather(out, inp, group):
    """all-gather of `inp` into the rank-major `out` ([W * inp.shape[0], ...])."""
    import torch.distributed as dist

    if _backend(group) == "nccl":
        dist.all_gather_into_tensor(out, inp, group=group)
    else:  # gloo: the list form writes straight into the views of `out`
        dist.all_gather(list(out.chunk(dist.get_world_size(group), 0)), inp, group=group)


def _reduce_scatter(out, inp, group):
    """out = this rank's slice of the sum over ranks of `inp` ([W * out.shape[0], ...])."""
    import torch.distributed as dist

    if _backend(group) == "nccl":
        dist.reduce_scatter_tensor(out, inp, group=group)
    else:  # gloo has no reduce-scatter
        dist.all_reduce(inp, group=group)
        r = dist.get_rank(group)
        n = out.shape[0]
        out.copy_(inp[r * n:(r + 1) * n])


class _Comm:
    """Collectives of the head slices on a side stream (CUDA) or inline (CPU). On CUDA each
    collective waits for an event recorded on the compute stream after its input was made, and
    signals one that the compute stream waits for before reading the output."""

    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None

    def run(self, fn, *tensors, after=None):
        """fn() on the comm stream once the compute stream has reached this point (and the
        events in `after`); returns an event to wait for (None on CPU)."""
        if not self.cuda:
            fn()
            return None
        import torch

        ready = torch.cuda.Event()
        ready.record()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            for ev in after or ():
                if ev is not None:
                    self.stream.wait_event(ev)
            fn()
            for t in tensors:
                t.record_stream(self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def mark(self):
        """An event at the compute stream's current point (None on CPU)."""
        if not self.cuda:
            return None
        import torch

        ev = torch.cuda.Event()
        ev.record()
        return ev

    @staticmethod
    def wait(ev):
        if ev is not None:
            import torch

            torch.cuda.current_stream().wait_event(ev)


def _gathered_kv(k, v, stride, group, plan, comm, keep=False):
    """Yields (kv-head slice, K, V) for every kv-head slice: in place, the gathered (rank-major) K
    and V themselves (two all-gathers; read through ``plan.kv_block_table``); else the keys the
    local rows need in sequence order (one all-gather of K and V together, one index_select each).
    The all-gather of slice i+1 is issued before slice i is handed out (double buffer; with `keep`,
    one buffer per slice, so that every yielded K, V stays valid after the loop)."""
    import torch

    w, tl, m = plan.world_size, plan.total_local, plan.block
    n = k.shape[1] // stride
    d = k.shape[2]
    in_place = plan.kv_block_table is not None
    rows = w * m if in_place else w * 2 * m
    nbuf = n if keep and in_place else min(n, 2)
    bufs = [[torch.empty((rows, stride, d), dtype=k.dtype, device=k.device) for _ in range(1 + in_place)]
            for _ in range(nbuf)]
    done, free = [None] * n, [None] * nbuf

    def start(i):
        hs = slice(i * stride, (i + 1) * stride)
        buf = bufs[i % nbuf]
        if m == 0:  # no token in the whole batch (every rank knows): nothing to gather
            return
        if in_place:
            # k, v themselves when one slice holds every kv head (no copy)
            lk, lv = (k, v) if n == 1 else (k[:, hs].contiguous(), v[:, hs].contiguous())

            def gather():
                _all_gather(buf[0], lk, group)
                _all_gather(buf[1], lv, group)
            done[i] = comm.run(gather, lk, lv, buf[0], buf[1], after=[free[i % nbuf]])
        else:
            if tl == m:
                local = torch.stack([k[:, hs], v[:, hs]]).reshape(2 * m, stride, d)
            else:  # this shard is shorter than the longest: padded at its end (zeros, never read)
                local = torch.zeros((2, m, stride, d), dtype=k.dtype, device=k.device)
                local[0, :tl] = k[:, hs]
                local[1, :tl] = v[:, hs]
                local = local.view(2 * m, stride, d)
            done[i] = comm.run(lambda: _all_gather(buf[0], local, group), local, buf[0], after=[free[i % nbuf]])

    if not in_place:
        k_rows, v_rows = plan.rows(k.device)
    start(0)
    for i in range(n):
        if i + 1 < n:
            start(i + 1)
        comm.wait(done[i])
        buf = bufs[i % nbuf]
        if in_place:
            kk, vv = buf
        else:
            kk, vv = buf[0].index_select(0, k_rows), buf[0].index_select(0, v_rows)
            free[i % nbuf] = comm.mark()  # the buffer may be overwritten once the two copies are done
        yield slice(i * stride, (i + 1) * stride), kk, vv
        if in_place:
            free[i % nbuf] = comm.mark()  # the attention that read the buffer is enqueued


def _attend(q, k, v, plan, scale, causal):
    """out, lse of this rank's rows: the plan's grouped calls (rows in no group of a call get zero
    output and lse +inf there, so the outputs add up exactly and the lse is the minimum)."""
    import torch

    from . import grouped_flash_attn_func

    if not plan.calls:  # no token on this rank
        return torch.zeros_like(q), torch.full((q.shape[1], q.shape[0]), float("inf"), device=q.device)
    out = lse = None
    for qr, kr, win in plan.calls:
        o, l = grouped_flash_attn_func(q, k, v, qr, kr, softmax_scale=scale, causal=causal, window_size=win,
                                       return_lse=True, kv_block_table=plan.kv_block_table)
        out, lse = (o, l) if out is None else (out + o, torch.minimum(lse, l))
    return out, lse


def _attend_backward(dout, q, k, v, out, lse, plan, scale, causal, deterministic):
    """dq, dk, dv of `_attend` (dk, dv over the key buffer; float32 where several calls add up)."""
    import torch

    from . import grouped_flash_attn_backward

    if not plan.calls:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    grads = None
    for qr, kr, win in plan.calls:
        g = grouped_flash_attn_backward(dout, q, k, v, out, lse, qr, kr, softmax_scale=scale, causal=causal,
                                        window_size=win, deterministic=deterministic,
                                        kv_block_table=plan.kv_block_table)
        if grads is None:
            grads = list(g)
        else:  # dq: rows of other calls are zero there (exact); dk, dv summed in float32
            grads = [grads[0] + g[0]] + [a.float() + b.float() for a, b in zip(grads[1:], g[1:])]
    return tuple(grads)


def _forward(q, k, v, plan, stride, scale, causal, group, keep):
    """out, lse and, with `keep`, the gathered K, V of every head slice (k0, v0, k1, v1, ...) for
    the backward."""
    import torch

    g = q.shape[1] // k.shape[1]
    comm = _Comm(q.device)
    outs, lses, kept = [], [], []
    for hs, kk, vv in _gathered_kv(k, v, stride, group, plan, comm, keep):
        if keep:
            kept += [kk, vv]
        o, lse = _attend(q[:, hs.start * g:hs.stop * g], kk, vv, plan, scale, causal)
        outs.append(o)
        lses.append(lse)
    if len(outs) == 1:  # one head slice (heads_k_stride = heads_kv): no concatenation copy
        return outs[0], lses[0], kept
    return torch.cat(outs, 1), torch.cat(lses, 0), kept


def _backward(dout, q, k, v, out, lse, plan, stride, scale, causal, deterministic, group, kept=()):
    import torch

    g = q.shape[1] // k.shape[1]
    w, tl, m, d = plan.world_size, plan.total_local, plan.block, k.shape[2]
    comm = _Comm(q.device)
    n_slices = k.shape[1] // stride
    dq = torch.empty_like(q) if n_slices > 1 else None
    # Two ranks on NCCL, in place, one grouped call a slice (its dK, dV in the input dtype): each
    # rank's 16-bit dK, dV are reduce-scattered as they are, half the bytes and no float32 copies.
    # The sum of two is then rounded once to the dtype; the float32 path rounds it to float32 and
    # then to the dtype, the same value but for rare double-rounding ties. Three or more ranks
    # keep float32 partial sums (each 16-bit addition would round again).
    narrow = (w == 2 and plan.kv_block_table is not None and len(plan.calls) == 1 and k.dtype != torch.float32
              and _backend(group) == "nccl" and os.environ.get("CUBEATTN_ZIGZAG_RS_FLOAT32", "0") != "1")
    dkv_local = torch.empty((n_slices, 2 * m, stride, d), dtype=k.dtype if narrow else torch.float32,
                            device=k.device)
    pending = []
    if kept:  # the forward's gathered K, V (keep_gathered_kv): no second all-gather
        slices = [(slice(i * stride, (i + 1) * stride), kept[2 * i], kept[2 * i + 1]) for i in range(n_slices)]
    else:
        slices = _gathered_kv(k, v, stride, group, plan, comm)
    for i, (hs, kk, vv) in enumerate(slices):
        qs = slice(hs.start * g, hs.stop * g)
        dqi, dki, dvi = _attend_backward(dout[:, qs], q[:, qs], kk, vv, out[:, qs], lse[qs], plan, scale, causal,
                                         deterministic)
        if dq is None:  # one head slice: its dq is the whole dq (no copy)
            dq = dqi
        else:
            dq[:, qs] = dqi
        # the gathered (rank-major) layout [W, K then V, block, ...] in float32, then summed onto the
        # owners: in place, dK and dV are in that layout already (one cast-copy each, none when
        # `narrow`); else the ordered rows are scattered back (zeros where no local row read a key)
        if narrow:
            if m:
                dst_k, dst_v = dkv_local[i, :m], dkv_local[i, m:]
                dki, dvi = dki.contiguous(), dvi.contiguous()

                def rs_kv(dst_k=dst_k, dst_v=dst_v, dki=dki, dvi=dvi):
                    _reduce_scatter(dst_k, dki, group)
                    _reduce_scatter(dst_v, dvi, group)
                pending.append(comm.run(rs_kv, dki, dvi, dst_k, dst_v))
            continue
        if plan.kv_block_table is not None:
            dkv = torch.empty((w, 2, m, stride, d), dtype=torch.float32, device=k.device)
            dkv[:, 0].copy_(dki.view(w, m, stride, d))
            dkv[:, 1].copy_(dvi.view(w, m, stride, d))
            dkv = dkv.view(w * 2 * m, stride, d)
        else:
            k_rows, v_rows = plan.rows(k.device)
            make = torch.empty if plan.covers else torch.zeros
            dkv = make((w * 2 * m, stride, d), dtype=torch.float32, device=k.device)
            dkv.index_copy_(0, k_rows, dki.float())
            dkv.index_copy_(0, v_rows, dvi.float())
        dst = dkv_local[i]
        if m:  # (no token in the whole batch: nothing to sum)
            pending.append(comm.run(lambda dst=dst, dkv=dkv: _reduce_scatter(dst, dkv, group), dkv, dst))
    for ev in pending:
        comm.wait(ev)
    # dkv_local[i] is [2, block, stride, d] (K then V of slice i; this shard's rows first)
    dkv_local = dkv_local.view(n_slices, 2, m, stride, d)[:, :, :tl]
    dk = dkv_local[:, 0].permute(1, 0, 2, 3).reshape(tl, n_slices * stride, d).to(k.dtype)
    dv = dkv_local[:, 1].permute(1, 0, 2, 3).reshape(tl, n_slices * stride, d).to(v.dtype)
    return dq, dk, dv


_FN = None


def _function():
    """The torch.autograd.Function (made on first use: importing cubeattn does not import torch)."""
    global _FN
    if _FN is not None:
        return _FN
    import torch

    class ZigzagLlama3Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, plan, stride, scale, causal, deterministic, group, keep):
            out, lse, kept = _forward(q, k, v, plan, stride, scale, causal, group, keep)
            ctx.save_for_backward(q, k, v, out, lse, *kept)
            ctx.args = (plan, stride, scale, causal, deterministic, group)
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse, *kept = ctx.saved_tensors
            plan, stride, scale, causal, deterministic, group = ctx.args
            dq, dk, dv = _backward(dout.contiguous(), q, k, v, out, lse, plan, stride, scale, causal,
                                   deterministic, group, kept)
            return dq, dk, dv, None, None, None, None, None, None, None

    _FN = ZigzagLlama3Attention
    return _FN


def zigzag_llama3_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         heads_k_stride, local_k_slice=None, dropout_p=0.0, softmax_scale=None,
                                         causal=True, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                         return_attn_probs=False, group=None, *, full_cu_seqlens=None,
                                         keep_gathered_kv=False):
    """Attention of this rank's zigzag shard over the whole sequences of a process group.

    q [total_local, heads_q, d], k/v [total_local, heads_kv, d]: torch tensors of this rank's
    zigzag shard (``zigzag_split``), on CUDA (NCCL) or the CPU (gloo); cu_seqlens_q/k: the LOCAL
    cu_seqlens (``zigzag_cu_seqlens``; equal: self-attention), max_seqlen_q/k their longest local
    sequence (as flash-attn; checked, not needed). heads_k_stride: kv heads gathered per step (a
    divisor of heads_kv). local_k_slice: ring-flash-attention's argument; the zigzag layer always
    uses all gathered keys, so only None or slice(None) is accepted. The options follow
    ring-flash-attention's order (dropout_p, softmax_scale, causal, window_size, alibi_slopes,
    deterministic, return_attn_probs, group); window_size (left, right) is flash-attn's sliding
    window (-1 = unbounded side; ranks skip the gathered keys no local row can see); dropout_p,
    alibi_slopes and return_attn_probs must keep their defaults (NotImplementedError otherwise).
    Returns out like q; with autograd (dq local, dk/dv reduce-scattered to their owners).

    full_cu_seqlens (keyword only): the cu_seqlens of the full sequences (what ``zigzag_split`` was
    given), the same on every rank. Needed where a sequence's length is not a multiple of
    2 * world_size (the ranks' local lengths then differ and do not tell the full ones); then
    cu_seqlens_q must be ``zigzag_cu_seqlens(full_cu_seqlens, world_size, rank)``. Without it the
    full cu_seqlens are cu_seqlens_q times the world size (every local length must be even).
    Every rank must pass it when one does (else the ranks' collectives do not match).

    keep_gathered_kv (keyword only, default False): the backward all-gathers K,V again, as
    ring-flash-attention does, so a layer holds only its local K,V between forward and backward.
    True keeps the forward's gathered K,V for the backward instead (world_size times the local
    K,V per layer until its backward, as an all-gather + flash-attention baseline under autograd
    holds) and skips the backward's all-gather."""
    import torch
    import torch.distributed as dist

    from . import _flag, _unsupported, _window

    _unsupported(dropout_p, 0.0, alibi_slopes)
    window = _window(window_size)
    if any(x < -1 for x in window):
        raise ValueError(f"invalid argument `window_size`: {window}: each side must be -1 (unbounded) or >= 0")
    if _flag(return_attn_probs, "return_attn_probs"):
        raise NotImplementedError("`return_attn_probs` is not implemented by the zigzag layer (only False)")
    causal, deterministic = _flag(causal, "causal"), _flag(deterministic, "deterministic")
    keep = _flag(keep_gathered_kv, "keep_gathered_kv")

    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"invalid argument `{name}`: expected a torch tensor, got {type(x).__name__}")
        if x.dim() != 3:
            raise ValueError(f"invalid argument `{name}`: expected [total_tokens, heads, head_dim], got shape {tuple(x.shape)}")
        dtype_name(x, name)
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"invalid dtype for `{name}`: {x.dtype}; q is {q.dtype} (q, k, v must match)")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"invalid argument `k`: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"invalid argument `v`: shape {tuple(v.shape)} differs from k's {tuple(k.shape)}")
    tl, hq, d = q.shape
    hk = k.shape[1]
    if k.shape[0] != tl or k.shape[2] != d:
        raise ValueError(f"invalid argument `k`: shape {tuple(k.shape)} does not match q's {tuple(q.shape)} "
                         "(self-attention over the same local tokens)")
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"invalid argument `k`: heads_q {hq} is not a multiple of heads_kv {hk}")
    stride = _int(heads_k_stride, "heads_k_stride", 1)
    if hk % stride != 0:
        raise ValueError(f"invalid argument `heads_k_stride`: {stride} does not divide heads_kv {hk}")
    if local_k_slice is not None and local_k_slice != slice(None):
        raise ValueError("invalid argument `local_k_slice`: the zigzag layer attends all gathered keys; "
                         f"pass None or slice(None), got {local_k_slice!r}")
    cu_q, cu_k = _cu(cu_seqlens_q, "cu_seqlens_q"), _cu(cu_seqlens_k, "cu_seqlens_k")
    if cu_q.shape != cu_k.shape or (cu_q != cu_k).any():
        raise ValueError("invalid argument `cu_seqlens_k`: must equal cu_seqlens_q (zigzag self-attention)")
    if cu_q[0] != 0 or (np.diff(cu_q) < 0).any():
        raise ValueError(f"invalid argument `cu_seqlens_q`: must start at 0 and be non-decreasing, got {cu_q.tolist()}")
    if cu_q[-1] != tl:
        raise ValueError(f"invalid argument `cu_seqlens_q`: ends at {cu_q[-1]}, q has {tl} tokens")
    lens = np.diff(cu_q)
    full = None if full_cu_seqlens is None else _cu(full_cu_seqlens, "full_cu_seqlens")
    longest = int(lens.max()) if lens.size else 0
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if _int(m, name) < longest:
            raise ValueError(f"invalid argument `{name}`: {m} is less than the longest local sequence {longest}")
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))):
        raise TypeError(f"invalid argument `softmax_scale`: expected a float or None, got {type(softmax_scale).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("invalid argument `group`: torch.distributed is not initialized "
                         "(call torch.distributed.init_process_group first)")
    w, r = dist.get_world_size(group), dist.get_rank(group)
    if _backend(group) == "nccl" and not q.is_cuda:
        raise ValueError("invalid argument `q`: the process group uses NCCL, which needs CUDA tensors")
    if full is None:
        odd = np.nonzero(lens % 2)[0]
        if odd.size and w > 1:
            b = int(odd[0])
            raise ValueError(f"invalid argument `cu_seqlens_q`: local sequence {b} has {int(lens[b])} tokens, not a "
                             "multiple of 2 (two equal zigzag chunks per rank): pass the full sequences' "
                             "`full_cu_seqlens` (any lengths), or make every full length a multiple of "
                             "2 * world_size")
        full = (cu_q.astype(np.int64) * w).astype(np.int32)
    else:
        try:
            want = _core.zigzag_local_cu_seqlens(full, w, r)
        except ValueError as e:
            raise _rename(e, "full_cu_seqlens") from None
        if want.shape != cu_q.shape or (want != cu_q).any():
            raise ValueError(f"invalid argument `cu_seqlens_q`: {_short(cu_q)} is not rank {r}'s local cu_seqlens "
                             f"of `full_cu_seqlens` over {w} ranks: zigzag_cu_seqlens(full_cu_seqlens, {w}, {r}) = "
                             f"{_short(want)}")
    in_place = os.environ.get("CUBEATTN_ZIGZAG_IN_PLACE", "1") != "0"
    plan = _plan_for(full, w, r, bool(causal), window, in_place)
    scale = None if softmax_scale is None else float(softmax_scale)
    return _function().apply(q, k.contiguous(), v.contiguous(), plan, stride, scale, bool(causal),
                             bool(deterministic), group,
                             keep and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)))
