"""Block patterns for block-sparse attention (seed 004's random / local / strided / block-diagonal).

Each returns ``block_index`` int32 ``[B, H, q_blocks, top_k]`` for
:func:`cubeattn.block_sparse_attn_func`: row ``(b, h, qb)`` lists the key blocks query block
``qb`` attends; slots a pattern cannot fill (``top_k > k_blocks``, windows clipped at the
sequence ends, a short last diagonal group) hold ``-1``. With ``seed`` given, the deterministic
patterns shuffle the slot order of every row (indices need not be sorted); ``random`` draws its
blocks from ``seed``. ``top_k_for(k_blocks, ratio)`` turns a kept fraction into a ``top_k``.
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["random", "local", "strided", "block_diagonal", "top_k_for", "PATTERNS"]


def _dims(B, H, q_blocks, k_blocks, top_k):
    for name, x in (("B", B), ("H", H), ("q_blocks", q_blocks), ("k_blocks", k_blocks), ("top_k", top_k)):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 0:
            raise ValueError(f"invalid argument `{name}`: expected an int >= 0, got {x!r}")
    return int(B), int(H), int(q_blocks), int(k_blocks), int(top_k)


def top_k_for(k_blocks: int, ratio: float) -> int:
    """Slots that keep about `ratio` of `k_blocks` key blocks (at least 1, at most k_blocks)."""
    if not 0.0 < float(ratio) <= 1.0:
        raise ValueError(f"invalid argument `ratio`: must lie in (0, 1], got {ratio!r}")
    return max(1, min(int(k_blocks), int(round(float(ratio) * k_blocks))))


def _finish(rows, B, H, q_blocks, top_k, seed):
    """rows: function (h, qb) -> list of key blocks (same for every batch entry unless noted)."""
    out = np.full((B, H, q_blocks, top_k), -1, dtype=np.int32)
    for h in range(H):
        for qb in range(q_blocks):
            r = list(rows(h, qb))[:top_k]
            out[:, h, qb, :len(r)] = r
    return _shuffle(out, seed)


def _shuffle(out, seed):
    if seed is None:
        return out
    rng = np.random.default_rng(seed)
    perm = np.argsort(rng.random(out.shape), axis=-1)
    return np.ascontiguousarray(np.take_along_axis(out, perm, axis=-1))


def random(B, H, q_blocks, k_blocks, top_k, seed=0):
    """top_k distinct key blocks per row, uniformly at random (different per batch entry and head)."""
    B, H, q_blocks, k_blocks, top_k = _dims(B, H, q_blocks, k_blocks, top_k)
    rng = np.random.default_rng(seed)
    out = np.full((B, H, q_blocks, top_k), -1, dtype=np.int32)
    n = min(top_k, k_blocks)
    for b in range(B):
        if n:
            keys = rng.random((H, q_blocks, k_blocks))
            out[b, :, :, :n] = np.argsort(keys, axis=-1)[..., :n]
    return out


def _center(qb, q_blocks, k_blocks):
    """The key block at query block qb's relative position (its diagonal when Sq == Sk)."""
    return min(k_blocks - 1, int(math.floor((qb + 0.5) * k_blocks / q_blocks)))


def local(B, H, q_blocks, k_blocks, top_k, causal=False, seed=None):
    """Sliding window: the top_k key blocks around query block qb's diagonal block c. causal:
    blocks c-top_k+1 .. c (fewer near the start: -1 padded); otherwise a window of top_k blocks
    centred on c, shifted to stay inside 0..k_blocks."""
    B, H, q_blocks, k_blocks, top_k = _dims(B, H, q_blocks, k_blocks, top_k)

    def rows(h, qb):
        if k_blocks == 0:
            return []
        c = _center(qb, q_blocks, k_blocks)
        if causal:
            return range(max(0, c - top_k + 1), c + 1)
        w = min(top_k, k_blocks)
        start = min(max(0, c - w // 2), k_blocks - w)
        return range(start, start + w)
    return _finish(rows, B, H, q_blocks, top_k, seed)


def strided(B, H, q_blocks, k_blocks, top_k, seed=None):
    """Uniform sampling: key blocks (qb + h + t * stride) mod k_blocks, t < top_k, with
    stride = k_blocks // top_k (distinct blocks, a different phase per head and query block)."""
    B, H, q_blocks, k_blocks, top_k = _dims(B, H, q_blocks, k_blocks, top_k)

    def rows(h, qb):
        n = min(top_k, k_blocks)
        if n == 0:
            return []
        stride = max(1, k_blocks // n)
        return [(qb + h + t * stride) % k_blocks for t in range(n)]
    return _finish(rows, B, H, q_blocks, top_k, seed)


def block_diagonal(B, H, q_blocks, k_blocks, top_k, seed=None):
    """Block-structured: key blocks in groups of top_k consecutive blocks; query blocks split into
    as many equal groups, and group g's query blocks attend group g's key blocks (the last group
    may be shorter: -1 padded)."""
    B, H, q_blocks, k_blocks, top_k = _dims(B, H, q_blocks, k_blocks, top_k)

    def rows(h, qb):
        if top_k == 0 or k_blocks == 0:
            return []
        groups = math.ceil(k_blocks / top_k)
        g = min(groups - 1, qb * groups // max(q_blocks, 1))
        return range(g * top_k, min((g + 1) * top_k, k_blocks))
    return _finish(rows, B, H, q_blocks, top_k, seed)


PATTERNS = {"random": random, "local": local, "strided": strided, "block_diagonal": block_diagonal}
