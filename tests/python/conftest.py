import os

import numpy as np
import pytest

import cubeattn


def visible_mask(ql, kl, causal, window=(-1, -1)):
    """[ql, kl] bool: key j is visible to row i (flash-attn's definition, bottom-right aligned):
    j <= i + kl - ql with causal, and i + kl - ql - left <= j <= i + kl - ql + right for a
    window_size (left, right), -1 = unbounded side."""
    i = np.arange(ql)[:, None]
    j = np.arange(kl)[None, :]
    diag = i + kl - ql
    mask = np.ones((ql, kl), bool)
    if causal:
        mask &= j <= diag
    left, right = window
    if left >= 0:
        mask &= j >= diag - left
    if right >= 0:
        mask &= j <= diag + right
    return mask


def ref_attention(q, k, v, segments, causal, scale=None, window=(-1, -1)):
    """f64 numpy reference over (q_start, q_len, k_start, k_len) segments; bottom-right causal and
    sliding window."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    tq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    out = np.zeros((tq, hq, v.shape[2]))  # v's head_dim (DeepSeek's MLA: q, k 192, v 128)
    lse = np.full((hq, tq), np.inf)
    for (qs, ql, ks, kl) in segments:
        if ql == 0 or kl == 0:
            continue
        kk = np.repeat(k[ks:ks + kl], g, axis=1)  # [kl, hq, d]
        vv = np.repeat(v[ks:ks + kl], g, axis=1)
        s = np.einsum("qhd,khd->hqk", q[qs:qs + ql], kk) * scale
        s = np.where(visible_mask(ql, kl, causal, window), s, -np.inf)
        m = s.max(-1, keepdims=True)
        seen = np.isfinite(m)
        m = np.where(seen, m, 0.0)
        p = np.exp(s - m)
        l = p.sum(-1, keepdims=True)
        p = np.where(l > 0, p / np.where(l > 0, l, 1), 0.0)
        out[qs:qs + ql] = np.einsum("hqk,khd->qhd", p, vv)
        lse[:, qs:qs + ql] = np.where(l[..., 0] > 0, (m + np.log(np.where(l > 0, l, 1)))[..., 0], np.inf)
    return out, lse


def ref_backward(q, k, v, dout, segments, causal, scale=None, window=(-1, -1), abs_sums=False):
    """f64 gradients by the explicit softmax Jacobian (small sizes only). With abs_sums, also the
    sums of the magnitudes of each gradient element's terms (dq: |dS| |k|, dk: |dS| |q|, dv:
    P |dout|, with |dS| + P * sum(|out * dout|) for |dS|: delta = rowsum(dout * out) of a stored,
    rounded out): times a unit roundoff, the error of rounding out, P or dS to that precision."""
    q, k, v, dout = (np.asarray(x, dtype=np.float64) for x in (q, k, v, dout))
    tq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    sq, sk, sv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for (qs, ql, ks, kl) in segments:
        if ql == 0 or kl == 0:
            continue
        kk = np.repeat(k[ks:ks + kl], g, axis=1)
        vv = np.repeat(v[ks:ks + kl], g, axis=1)
        s = np.einsum("qhd,khd->hqk", q[qs:qs + ql], kk) * scale
        s = np.where(visible_mask(ql, kl, causal, window), s, -np.inf)
        m = s.max(-1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        p = np.exp(s - m)
        l = p.sum(-1, keepdims=True)
        p = np.where(l > 0, p / np.where(l > 0, l, 1), 0.0)
        do = dout[qs:qs + ql]
        dvv = np.einsum("hqk,qhd->khd", p, do)
        dp = np.einsum("qhd,khd->hqk", do, vv)
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))
        dq[qs:qs + ql] += np.einsum("hqk,khd->qhd", ds, kk) * scale
        dkk = np.einsum("hqk,qhd->khd", ds, q[qs:qs + ql]) * scale
        dk[ks:ks + kl] += dkk.reshape(kl, hkv, g, d).sum(2)
        dv[ks:ks + kl] += dvv.reshape(kl, hkv, g, v.shape[2]).sum(2)
        if abs_sums:
            o = np.einsum("hqk,khd->qhd", p, vv)
            ads = np.abs(ds) + p * np.einsum("qhd,qhd->hq", np.abs(o), np.abs(do))[..., None]
            sq[qs:qs + ql] += np.einsum("hqk,khd->qhd", ads, np.abs(kk)) * scale
            skk = np.einsum("hqk,qhd->khd", ads, np.abs(q[qs:qs + ql])) * scale
            sk[ks:ks + kl] += skk.reshape(kl, hkv, g, d).sum(2)
            sv[ks:ks + kl] += np.einsum("hqk,qhd->khd", p, np.abs(do)).reshape(kl, hkv, g, v.shape[2]).sum(2)
    return (dq, dk, dv, sq, sk, sv) if abs_sums else (dq, dk, dv)


def varlen_segments(cu_q, cu_k):
    return [(int(cu_q[b]), int(cu_q[b + 1] - cu_q[b]), int(cu_k[b]), int(cu_k[b + 1] - cu_k[b]))
            for b in range(len(cu_q) - 1)]


def grouped_segments(q_ranges, kv_ranges):
    return [(int(a), int(b - a), int(c), int(d - c)) for (a, b), (c, d) in zip(q_ranges, kv_ranges)]


def rel_err(a, b, floor=0.0):
    """||a - b|| / ||b||, the denominator at least `floor` (e.g. atol * sqrt(b.size): below that
    level the elementwise bound is the meaningful one) and 1 where both are 0."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    n = max(np.linalg.norm(b), floor)
    return np.linalg.norm(a - b) / (n if n > 0 else 1.0)



def assert_grad_close(g, want, tol, rel, atol, name, slack=None):
    """Elementwise within (tol, atol), and the relative-norm bound `rel` where the gradient is
    above the atol level (below it the stored out's rounding in delta = rowsum(dout * out)
    dominates tiny fp16 gradients). `slack` (an array), where given, is a rounding model's error
    allowance per element: both bounds apply to the error beyond it."""
    if slack is None:
        np.testing.assert_allclose(g, want, rtol=tol, atol=atol, err_msg=name)
        err = g - want
    else:
        err = np.maximum(np.abs(g - want) - slack, 0.0)
        bound = atol + tol * np.abs(want)
        if np.any(err > bound):
            i = np.unravel_index(np.argmax(err - bound), err.shape)
            raise AssertionError(f"{name}: {np.sum(err > bound)} of {err.size} elements off; worst at {i}: "
                                 f"{g[i]} vs {want[i]}, bound {bound[i]} + slack {slack[i]}")
    if np.linalg.norm(want) > atol * np.sqrt(want.size):
        assert np.linalg.norm(err) <= rel * np.linalg.norm(want), name

DTYPES = ["float32", "float16", "bfloat16"]
# forward: seed tolerance 1e-3 plus the output dtype's rounding; relative-norm bound per dtype
FWD_TOL = {"float32": (1e-5, 1e-5), "float16": (1e-3 + 2 ** -11, 2e-3), "bfloat16": (1e-3 + 2 ** -8, 8e-3)}
BWD_TOL = {"float32": (1e-4, 1e-4), "float16": (1e-2, 5e-3), "bfloat16": (1e-2, 2e-2)}


def np_dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def rand(rng, shape, dtype, amp=1.0):
    return rng.uniform(-amp, amp, size=shape).astype(np.float32).astype(np_dtype(dtype))


def cuda_available():
    try:
        return cubeattn.backend_status()["cuda_available"]
    except Exception:
        return False


def hopper():
    """Whether the first GPU runs the Hopper kernels (sm_90, not switched off by CUBEATTN_CUDA_SM90=0
    or CUBEATTN_CUDA_PORTABLE=1): the backward above head_dim 128 exists only there."""
    if not cuda_available():
        return False
    devs = cubeattn.devices()
    return (bool(devs) and tuple(devs[0]["compute_capability"])[0] == 9
            and os.environ.get("CUBEATTN_CUDA_SM90") != "0" and os.environ.get("CUBEATTN_CUDA_PORTABLE") != "1")


def pytest_collection_modifyitems(config, items):
    if cuda_available():
        return
    reason = cubeattn.backend_status()["reason"]
    skip = pytest.mark.skip(reason=f"no usable CUDA backend: {reason}")
    for it in items:
        if "gpu" in it.keywords:
            it.add_marker(skip)


# ---------------------------------------------------------------- block-sparse reference

def sparse_token_mask(block_index, b, q_len, k_len, q_block, k_block, heads_q, causal):
    """[heads_q, q_len, k_len] bool: the token mask of sequence b expanded from block_index
    [B, H, q_blocks, top_k] (-1 = unused; H = heads_q or heads_kv), with bottom-right causal."""
    ix = np.asarray(block_index)[b]  # [H, q_blocks, top_k]
    h_idx, qbn, _ = ix.shape
    kbn = max(1, -(-k_len // k_block))
    keep = np.zeros((h_idx, qbn, kbn), bool)
    for h in range(h_idx):
        for qb in range(qbn):
            for x in ix[h, qb]:
                if x >= 0:
                    keep[h, qb, x] = True
    rq = np.arange(q_len) // q_block
    rk = np.arange(k_len) // k_block
    mask = keep[:, rq][:, :, rk]  # [H, q_len, k_len]
    if h_idx != heads_q:
        mask = np.repeat(mask, heads_q // h_idx, axis=0)
    if causal:
        mask = mask & (np.arange(k_len)[None, :] <= k_len - q_len + np.arange(q_len)[:, None])[None]
    return mask


def _masked_probs(qs, kk, mask, scale):
    s = np.einsum("qhd,khd->hqk", qs, kk) * scale
    s = np.where(mask, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    p = np.where(l > 0, p / np.where(l > 0, l, 1), 0.0)
    lse = np.where(l[..., 0] > 0, (m + np.log(np.where(l > 0, l, 1)))[..., 0], np.inf)
    return p, lse


def ref_sparse(q, k, v, block_index, cu_q, cu_k, q_block, k_block, causal, scale=None, dout=None):
    """f64 block-sparse attention in the varlen layout: dense softmax under the token mask expanded
    from the block mask. Returns (out, lse) or, with dout, (out, lse, dq, dk, dv) by the explicit
    softmax Jacobian."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    tq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    out = np.zeros((tq, hq, v.shape[2]))  # v's head_dim (DeepSeek's MLA: q, k 192, v 128)
    lse = np.full((hq, tq), np.inf)
    grads = [np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)] if dout is not None else None
    if dout is not None:
        dout = np.asarray(dout, dtype=np.float64)
    for b in range(len(cu_q) - 1):
        qs, ql = int(cu_q[b]), int(cu_q[b + 1] - cu_q[b])
        ks, kl = int(cu_k[b]), int(cu_k[b + 1] - cu_k[b])
        if ql == 0 or kl == 0:
            continue
        mask = sparse_token_mask(block_index, b, ql, kl, q_block, k_block, hq, causal)
        kk = np.repeat(k[ks:ks + kl], g, axis=1)
        vv = np.repeat(v[ks:ks + kl], g, axis=1)
        p, l = _masked_probs(q[qs:qs + ql], kk, mask, scale)
        out[qs:qs + ql] = np.einsum("hqk,khd->qhd", p, vv)
        lse[:, qs:qs + ql] = l
        if dout is not None:
            do = dout[qs:qs + ql]
            dvv = np.einsum("hqk,qhd->khd", p, do)
            dp = np.einsum("qhd,khd->hqk", do, vv)
            ds = p * (dp - (p * dp).sum(-1, keepdims=True))
            grads[0][qs:qs + ql] += np.einsum("hqk,khd->qhd", ds, kk) * scale
            dkk = np.einsum("hqk,qhd->khd", ds, q[qs:qs + ql]) * scale
            grads[1][ks:ks + kl] += dkk.reshape(kl, hkv, g, d).sum(2)
            grads[2][ks:ks + kl] += dvv.reshape(kl, hkv, g, d).sum(2)
    if dout is None:
        return out, lse
    return (out, lse, *grads)


# INT8 Q K^T (block-sparse): the documented quantisation in numpy. Rules (chunk, period, width) on
# a row's offset inside its block: group = (o // chunk) * period + (o % chunk % period) // width.
INT8_RULES = {
    "per_block": (lambda qb: (qb, qb, qb), lambda kb: (kb, kb, kb)),
    "per_warp": (lambda qb: (32, 32, 32), lambda kb: (64, 64, 64)),
    "per_thread": (lambda qb: (16, 8, 1), lambda kb: (64, 8, 2)),
}


def _quantize_rows(x, block, rule):
    """x [n, heads, d] f32 rows of one sequence -> (dequantised f64 rows, int8 rows, per-row scale)."""
    chunk, period, width = rule
    n = x.shape[0]
    o = np.arange(n) % block
    gid = (np.arange(n) // block) * (block + 64) + (o // chunk) * period + (o % chunk % period) // width
    amax = np.abs(x).max(-1)  # [n, heads]
    scale = np.ones_like(amax, dtype=np.float32)
    xq = np.zeros(x.shape, np.int8)
    for g in np.unique(gid):
        rows = gid == g
        a = amax[rows].max(0).astype(np.float32)  # per head
        s = np.where(a > 0, a / np.float32(127), np.float32(1)).astype(np.float32)
        inv = np.where(a > 0, np.float32(127) / np.where(a > 0, a, 1), np.float32(0)).astype(np.float32)
        xq[rows] = np.clip(np.rint(x[rows] * inv[None, :, None]), -127, 127).astype(np.int8)
        scale[rows] = s[None, :]
    return xq.astype(np.float64) * scale[..., None].astype(np.float64), xq, scale


def int8_operands(q, k, cu_q, cu_k, gran, q_block, k_block, smooth=True, scale=None):
    """The INT8 option's operands in the varlen layout: (dequantised q, dequantised smoothed k, lse
    shift [hq, total_q]); f64 attention over them is the INT8 path's exact result."""
    q = np.asarray(q, np.float32)
    k = np.asarray(k, np.float32)
    tq, hq, d = q.shape
    hkv = k.shape[1]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    qd, kd = np.zeros(q.shape), np.zeros(k.shape)
    shift = np.zeros((hq, tq))
    qr, kr = INT8_RULES[gran]
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        kk = k[ks:ke]
        if smooth and ke > ks:
            mean = kk.astype(np.float64).mean(0).astype(np.float32)  # [hkv, d]
            kk = (kk - mean[None]).astype(np.float32)
            qq = q[qs:qe].astype(np.float64)
            shift[:, qs:qe] = (scale * np.einsum("qhd,hd->hq", qq, np.repeat(mean, hq // hkv, 0).astype(np.float64)))
        if qe > qs:
            qd[qs:qe] = _quantize_rows(q[qs:qe], q_block, qr(q_block))[0]
        if ke > ks:
            kd[ks:ke] = _quantize_rows(kk, k_block, kr(k_block))[0]
    return qd, kd, shift


def int8_accuracy(got, want):
    """(cosine similarity, relative L1, RMSE) of `got` against `want`."""
    g, w = np.asarray(got, np.float64).ravel(), np.asarray(want, np.float64).ravel()
    cos = g @ w / max(np.linalg.norm(g) * np.linalg.norm(w), 1e-300)
    l1 = np.abs(g - w).sum() / max(np.abs(w).sum(), 1e-30)
    rmse = np.sqrt(np.mean((g - w) ** 2))
    return cos, l1, rmse
