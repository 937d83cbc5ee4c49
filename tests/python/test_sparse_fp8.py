"""Block-sparse FP8 P.V (``pv_precision="fp8"``, SageAttention2's P.V; only with INT8 Q K^T): the
CPU emulation against the f64 reference of the unquantised attention and against a numpy model
of the documented rule (ml_dtypes' float8_e4m3fn for the rounding, an implementation independent of
cubeattn's), the spec and its cache, and every refused call. Fresh random inputs (the seed is
printed)."""
import numpy as np
import pytest

import cubeattn
from cubeattn import sparse_patterns as sp
from conftest import int8_operands, np_dtype, ref_sparse, sparse_token_mask

ml_dtypes = pytest.importorskip("ml_dtypes")

FP8_MAX = 448.0
P_SCALE = 256.0
TILE = 64  # keys per tile, counted from each key block's start


def fresh_rng(name):
    seed = int(np.random.SeedSequence().entropy % 2 ** 32)
    print(f"{name}: seed {seed}")
    return np.random.default_rng(seed)


def accuracy(got, want, v):
    """(cosine similarity, relative L2 error); the L2 denominator is at least 5% of v's RMS per
    element (test_sage.py's measure)."""
    g, w = np.asarray(got, np.float64).ravel(), np.asarray(want, np.float64).ravel()
    cos = g @ w / max(np.linalg.norm(g) * np.linalg.norm(w), 1e-300)
    v_rms = np.sqrt(np.mean(np.asarray(v, np.float64) ** 2))
    return cos, np.linalg.norm(g - w) / max(np.linalg.norm(w), 0.05 * v_rms * np.sqrt(w.size))


def e4m3(x):
    """Round-to-nearest-even e4m3 with saturation (finite inputs), as f64 values."""
    x = np.clip(np.asarray(x, np.float32), -FP8_MAX, FP8_MAX)
    return x.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def fp8_model(q, k, v, ix, cu_q, cu_k, q_block, k_block, causal, gran, smooth=True, tile_max=True, v_per_channel=True):
    """The documented FP8 P.V rule in numpy (varlen layout, float32 inputs): INT8 operands
    (conftest.int8_operands), V per (sequence, kv head, channel) to e4m3 with scale amax / 448,
    per 64-key tile of each listed key block one online-softmax step, e4m3(256 P) times the e4m3 V,
    l of the unrounded 256 P, out = acc / l * scale, lse of the unscaled sums plus the smoothing
    shift. `tile_max=False`: P relative to the row's final max instead (a wrong rule, to show the
    comparison can tell); `v_per_channel=False`: one V scale per (sequence, kv head) (wrong too)."""
    tq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qd, kd, shift = int8_operands(q, k, cu_q, cu_k, gran, q_block, k_block, smooth)
    scale = 1.0 / np.sqrt(d)
    out = np.zeros((tq, hq, d))
    lse = np.full((hq, tq), np.inf)
    for b in range(len(cu_q) - 1):
        qs, ql = int(cu_q[b]), int(cu_q[b + 1] - cu_q[b])
        ks, kl = int(cu_k[b]), int(cu_k[b + 1] - cu_k[b])
        if kl == 0 or ql == 0:
            continue
        vv = np.asarray(v[ks:ks + kl], np.float32)  # [kl, hkv, d]
        amax = np.abs(vv).max(0) if v_per_channel else np.repeat(np.abs(vv).max((0, 2))[:, None], d, 1)
        amax = amax.astype(np.float32)
        inv = np.where(amax > 0, np.float32(FP8_MAX) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
        vscale = np.where(amax > 0, amax / np.float32(FP8_MAX), 1).astype(np.float32)
        vq = e4m3(vv * inv[None])  # [kl, hkv, d]
        mask = sparse_token_mask(ix, b, ql, kl, q_block, k_block, hq, causal)  # [hq, ql, kl]
        for h in range(hq):
            hk = h // g
            s = (qd[qs:qs + ql, h] @ kd[ks:ks + kl, hk].T) * scale  # [ql, kl]
            for r in range(ql):
                vis = mask[h, r]
                if not vis.any():
                    continue
                keys = np.flatnonzero(vis)
                blocks = np.unique(keys // k_block)
                m, l, acc = -np.inf, 0.0, np.zeros(d)
                final = s[r, keys].max()
                for kb in blocks:
                    for t0 in range(kb * k_block, min((kb + 1) * k_block, kl), TILE):
                        t1 = min(t0 + TILE, (kb + 1) * k_block, kl)
                        sel = np.flatnonzero(vis[t0:t1]) + t0
                        if len(sel) == 0:
                            continue
                        m_new = max(m, s[r, sel].max()) if tile_max else final
                        alpha = np.exp(m - m_new) if np.isfinite(m) else 0.0
                        p = np.exp(s[r, sel] - m_new)
                        acc = acc * alpha + e4m3(P_SCALE * p) @ vq[sel, hk]
                        l = l * alpha + P_SCALE * p.sum()
                        m = m_new
                out[qs + r, h] = acc / l * vscale[hk]
                lse[h, qs + r] = m + np.log(l / P_SCALE) + shift[h, qs + r]
    return out, lse


def varlen_case(rng, lens, hq, hkv, d, q_block, k_block, index_heads, dtype="float32", outliers=False):
    cu_q = np.cumsum([0] + [a for a, _ in lens]).astype(np.int32)
    cu_k = np.cumsum([0] + [b for _, b in lens]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], hq, d)).astype(np.float32)
    k = rng.standard_normal((cu_k[-1], hkv, d)).astype(np.float32)
    v = rng.standard_normal((cu_k[-1], hkv, d)).astype(np.float32)
    if outliers:
        v[..., [3, 17]] *= 40.0
        v[..., 9] += 25.0
    q, k, v = (x.astype(np_dtype(dtype)) for x in (q, k, v))
    mq, mk = max(a for a, _ in lens), max(b for _, b in lens)
    qbn, kbn = -(-mq // q_block), -(-mk // k_block)
    ix = sp.random(len(lens), index_heads, qbn, kbn, max(1, (2 * kbn + 2) // 3), seed=int(rng.integers(1 << 30)))
    for b, (_, kl) in enumerate(lens):
        ix[b][ix[b] >= -(-kl // k_block)] = -1
    return q, k, v, cu_q, cu_k, ix


# (lens, hq, hkv, d, q_block, k_block, index per kv head, causal, dtype, outliers)
CASES = [
    ([(150, 200), (5, 0), (0, 60), (70, 333)], 4, 2, 64, 64, 128, False, True, "float16", False),
    ([(300, 333)], 2, 1, 128, 48, 80, True, False, "bfloat16", False),
    ([(200, 517)], 4, 4, 64, 64, 128, False, True, "float32", True),
    ([(129, 700), (260, 260)], 8, 2, 128, 128, 128, True, True, "bfloat16", True),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_fp8_pv_against_the_f64_reference(case):
    """Varlen with empty sequences, GQA, causal, head_dim 64 and 128, blocks that are not multiples
    of 64, a key count off the block size, V channels with large magnitudes: cosine >= 0.999 and
    relative L2 <= 0.05; the lse is the true one (the 256 of P does not reach it); rows that see no
    key: zero output, lse +inf."""
    lens, hq, hkv, d, qb, kb, per_kv, causal, dtype, outliers = CASES[case]
    rng = fresh_rng(f"fp8 case {case}")
    q, k, v, cu_q, cu_k, ix = varlen_case(rng, lens, hq, hkv, d, qb, kb, hkv if per_kv else hq, dtype, outliers)
    want, wl = ref_sparse(q, k, v, ix, cu_q, cu_k, qb, kb, causal)
    kw = dict(q_block=qb, k_block=kb, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True,
              device="cpu", quant_gran="per_warp")
    out, lse = cubeattn.block_sparse_attn_func(q, k, v, ix, pv_precision="fp8", **kw)
    assert cubeattn.last_backend() == "cpu" and out.dtype == q.dtype and out.shape == q.shape
    out8, lse8 = cubeattn.block_sparse_attn_func(q, k, v, ix, **kw)
    cos, rel = accuracy(out, want, v)
    cos8, rel8 = accuracy(out8, want, v)
    fin = np.isfinite(wl)
    print(f"fp8: cosine {cos:.6f} rel L2 {rel:.4f}; int8 only: cosine {cos8:.6f} rel L2 {rel8:.4f}; "
          f"max |lse err| {np.abs(lse[fin] - wl[fin]).max():.4f}")
    assert cos >= 0.999 and rel <= 0.05
    assert rel > rel8, "FP8 P.V must cost accuracy over INT8 alone (or it did not run)"
    assert np.array_equal(np.isfinite(lse), fin)
    assert np.all(np.asarray(out, np.float32)[~fin.T] == 0)
    np.testing.assert_allclose(lse[fin], lse8[fin], rtol=1e-5, atol=1e-5)
    assert np.abs(lse[fin] - wl[fin]).max() < 0.1


@pytest.mark.parametrize("gran", ["per_block", "per_warp", "per_thread"])
def test_fp8_cpu_is_the_documented_rule(gran):
    """float32 inputs: the CPU path equals the numpy model of the documented rule up to rare P
    roundings that land on the other side of an e4m3 midpoint (the CPU's f32 scores and exp2
    and the model's f64 ones differ in the last bits; one such P moves its row by up to 1/8 of
    that key's V share); the wrong rules (P against the row's final max; one V scale per kv head)
    move most rows."""
    rng = fresh_rng(f"fp8 rule {gran}")
    lens = [(150, 333), (70, 90)]
    hq, hkv, d, qb, kb = 4, 2, 32, 48, 80
    q, k, v, cu_q, cu_k, ix = varlen_case(rng, lens, hq, hkv, d, qb, kb, hq)
    k = k + (3.0 * rng.standard_normal(d)).astype(np.float32)  # smoothing matters
    v[..., 5] *= 30.0  # a channel far larger than the rest
    out, lse = cubeattn.block_sparse_attn_func(q, k, v, ix, q_block=qb, k_block=kb, causal=True, cu_seqlens_q=cu_q,
                                               cu_seqlens_k=cu_k, quant_gran=gran, pv_precision="fp8",
                                               return_lse=True, device="cpu")
    out = np.asarray(out, np.float64)
    model = lambda **kw: fp8_model(q, k, v, ix, cu_q, cu_k, qb, kb, True, gran, **kw)  # noqa: E731
    want, wl = model()
    fin = np.isfinite(wl)
    assert np.array_equal(fin, np.isfinite(lse))
    np.testing.assert_allclose(lse[fin], wl[fin], atol=2e-4, rtol=1e-5)
    seen = fin.T  # [total_q, hq]: rows that see a key

    def rows_off(x):
        """The fraction of the (row, head) outputs (of rows that see a key) off `x` anywhere."""
        return np.mean((np.abs(out - x) > 1e-4 * (1 + np.abs(x))).any(-1)[seen])

    frac = rows_off(want)
    frac_final, frac_tensor = rows_off(model(tile_max=False)[0]), rows_off(model(v_per_channel=False)[0])
    print(f"rows off the model: {frac:.2e} (final-max rule {frac_final:.2e}, per-head V scale {frac_tensor:.2e}); "
          f"max |diff| {np.abs(out - want).max():.2e}")
    assert frac <= 0.03 and np.abs(out - want).max() < 0.15 * np.abs(v).max()
    assert frac_final > 0.2 and frac_tensor > 0.2


def test_fp8_spec_cache_and_prepared_spec():
    """pv_precision is part of the spec (and of the spec cache's key): two specs that differ only
    in it are different objects with different results; a prepared spec carries it."""
    rng = fresh_rng("fp8 spec")
    q, k, v = (rng.standard_normal((1, 256, 2, 32)).astype(np.float32) for _ in range(3))
    ix = sp.random(1, 2, 4, 2, 2, seed=0)
    args = ((256, 2, 32), (256, 2, 32), "float32", [0, 256], [0, 256], 256, 256, ix)
    s8 = cubeattn.sparse_spec(*args, quant_gran="per_warp")
    s8f = cubeattn.sparse_spec(*args, quant_gran="per_warp", pv_precision="fp8")
    assert s8 is not s8f and s8 is cubeattn.sparse_spec(*args, quant_gran="per_warp")
    assert s8f is cubeattn.sparse_spec(*args, quant_gran="per_warp", pv_precision="fp8")
    assert (s8.pv_precision, s8f.pv_precision, s8f.qk_int8) == (None, "fp8", "per_warp")
    assert "pv_precision=Some(\"fp8\")" in repr(s8f)
    a = cubeattn.block_sparse_attn_func(q, k, v, s8f)
    b = cubeattn.block_sparse_attn_func(q, k, v, s8)
    assert not np.array_equal(a, b)
    assert np.array_equal(a, cubeattn.block_sparse_attn_func(q, k, v, ix, quant_gran="per_warp", pv_precision="fp8"))
    assert np.array_equal(b, cubeattn.block_sparse_attn_func(q, k, v, ix, quant_gran="per_warp", pv_precision=None))
    # a prepared spec fixes it, as it fixes quant_gran
    for spec in (s8, s8f):
        with pytest.raises(ValueError, match="pv_precision.*prepared SparseSpec fixes it"):
            cubeattn.block_sparse_attn_func(q, k, v, spec, pv_precision="fp8")


def _bad():
    yield dict(pv_precision="fp8"), "pv_precision.*INT8"
    yield dict(pv_precision="fp8", quant_gran=None, qk_int8=False), "pv_precision.*INT8"
    yield dict(pv_precision="bf16", quant_gran="per_warp"), "pv_precision"
    yield dict(pv_precision="FP8", quant_gran="per_warp"), "pv_precision"
    yield dict(pv_precision=8, quant_gran="per_warp"), "pv_precision"
    yield dict(pv_precision=True, quant_gran="per_warp"), "pv_precision"


@pytest.mark.parametrize("case", range(len(list(_bad()))))
def test_fp8_bad_arguments_raise_naming_pv_precision(case):
    kw, match = list(_bad())[case]
    q, k, v = (np.zeros((1, 64, 2, 16), np.float32) for _ in range(3))
    ix = np.zeros((1, 2, 1, 1), np.int32)
    with pytest.raises(ValueError, match=match):
        cubeattn.block_sparse_attn_func(q, k, v, ix, **kw)
    with pytest.raises(ValueError, match=match):
        cubeattn.sparse_spec((64, 2, 16), (64, 2, 16), "float32", [0, 64], [0, 64], 64, 64, ix, **kw)


def test_fp8_native_spec_needs_int8():
    """The native binding refuses FP8 P.V without the INT8 option, naming pv_precision."""
    ix = np.zeros(2, np.int32)
    cu = np.array([0, 64], np.int32)
    with pytest.raises(ValueError, match="pv_precision.*INT8"):
        cubeattn._core.varlen_spec([64, 2, 16], [64, 2, 16], [64, 2, 16], "float32", cu, cu, 64, 64, None, False,
                                   (-1, -1), ix, [1, 2, 1, 1], 64, 128, None, True, True)
    s = cubeattn._core.varlen_spec([64, 2, 16], [64, 2, 16], [64, 2, 16], "float32", cu, cu, 64, 64, None, False,
                                   (-1, -1), ix, [1, 2, 1, 1], 64, 128, "per_block", True, True)
    assert s.pv_precision == "fp8" and s.qk_int8 == "per_block"


def test_fp8_with_autograd_inputs_is_refused():
    torch = pytest.importorskip("torch")
    q = torch.randn(1, 64, 2, 16, requires_grad=True)
    k, v = torch.randn(1, 128, 2, 16), torch.randn(1, 128, 2, 16)
    ix = np.zeros((1, 2, 1, 1), np.int32)
    with pytest.raises(ValueError, match="quant_gran.*forward-only"):
        cubeattn.block_sparse_attn_func(q, k, v, ix, quant_gran="per_warp", pv_precision="fp8")
    with torch.no_grad():
        out = cubeattn.block_sparse_attn_func(q, k, v, ix, quant_gran="per_warp", pv_precision="fp8")
    assert isinstance(out, torch.Tensor) and torch.isfinite(out).all()


def test_bench_sparse_cpu_fp8_rows(capsys):
    from cubeattn import bench

    assert bench.main(["sparse", "--device", "cpu", "--seq_lens", "256", "--top_k_ratios", "0.5", "--iterations", "1",
                       "--pv-precision", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "cubeattn_cpu_sparse_int8_fp8" in out and "cubeattn_cpu_sparse_int8 " in out and "per_warp" in out
