"""flash-attn's inference surface: flash_attn_with_kvcache (in-place append, cache_batch_idx,
cache_leftpad, paged caches through block_table, windows, lse) and flash_attn_varlen_func's
block_table, against an f64 reference of flash-attn's documented semantics, on the CPU backend.
Paged caches run in place through kv_block_table (pages of a multiple of 64 keys, distinct, no
window, range starts on a page) or through the gather path otherwise: both are checked."""
import numpy as np
import pytest

import cubeattn
from cubeattn import _kvcache
from conftest import BWD_TOL, np_dtype, rand, ref_attention, ref_backward, rel_err

TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


def ref_rows(q, logical_k, logical_v, starts, ends, causal, window=(-1, -1), scale=None):
    """f64 (out [B, Sq, H, D], lse [B, H, Sq]): row b's queries against keys starts[b]:ends[b] of
    its logical cache row, bottom-right aligned."""
    b, sq, h, d = q.shape
    out, lse = np.zeros((b, sq, h, d)), np.zeros((b, h, sq))
    for r in range(b):
        ks, vs = logical_k[r, starts[r]:ends[r]], logical_v[r, starts[r]:ends[r]]
        o, l = ref_attention(q[r], ks, vs, [(0, sq, 0, ends[r] - starts[r])], causal, scale, window)
        out[r], lse[r] = o, l
    return out, lse


def to_pages(logical, table, num_pages):
    """[B, cap, h, d] logical rows -> [num_pages, page, h, d] through table [B, cap / page]."""
    b, cap, h, d = logical.shape
    page = cap // table.shape[1]
    pool = np.zeros((num_pages, page, h, d), logical.dtype)
    for r in range(b):
        for i, p in enumerate(table[r]):
            pool[p] = logical[r, i * page:(i + 1) * page]
    return pool


def from_pages(pool, table):
    b, n = table.shape
    return np.stack([np.concatenate([pool[p] for p in table[r]]) for r in range(b)])


def f64(x):
    return np.asarray(x, dtype=np.float32).astype(np.float64) if not hasattr(x, "detach") else \
        x.detach().float().numpy().astype(np.float64)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("new", [0, 1, 3])
def test_kvcache_append_batch_idx_leftpad(dtype, causal, new):
    rng = np.random.default_rng(1 + new + 10 * causal)
    b, sq, hq, hkv, d, bc, cap = 3, max(new, 1), 4, 2, 32, 5, 50
    q = rand(rng, (b, sq, hq, d), dtype)
    kc, vc = rand(rng, (bc, cap, hkv, d), dtype), rand(rng, (bc, cap, hkv, d), dtype)
    kn, vn = rand(rng, (b, new, hkv, d), dtype), rand(rng, (b, new, hkv, d), dtype)
    seqlens = np.array([0, 17, 44], np.int32)  # row 0: an empty cache
    batch_idx = np.array([4, 0, 2], np.int32)
    leftpad = np.array([0, 5, 12], np.int32)
    want_k, want_v = kc.copy(), vc.copy()
    for r in range(b):
        want_k[batch_idx[r], seqlens[r]:seqlens[r] + new] = kn[r]
        want_v[batch_idx[r], seqlens[r]:seqlens[r] + new] = vn[r]
    out, lse = cubeattn.flash_attn_with_kvcache(q, kc, vc, kn if new else None, vn if new else None,
                                                cache_seqlens=seqlens, cache_batch_idx=batch_idx,
                                                cache_leftpad=leftpad, causal=causal, return_softmax_lse=True)
    assert np.array_equal(f64(kc), f64(want_k)) and np.array_equal(f64(vc), f64(want_v))  # written in place
    rows_k, rows_v = f64(want_k)[batch_idx], f64(want_v)[batch_idx]
    ref, ref_lse = ref_rows(f64(q), rows_k, rows_v, leftpad, seqlens + new, causal)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (b, hq, sq)
    assert rel_err(f64(out), ref) <= TOL[dtype]
    seen = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[seen], ref_lse[seen], rtol=1e-5, atol=1e-5)
    assert np.all(np.isinf(lse[~seen])) and np.all(f64(out)[np.transpose(~seen, (0, 2, 1))] == 0)


def test_kvcache_window_and_int_seqlens_and_scale():
    rng = np.random.default_rng(2)
    q = rand(rng, (2, 4, 4, 16), "float32")
    kc, vc = rand(rng, (2, 40, 1, 16), "float32"), rand(rng, (2, 40, 1, 16), "float32")
    kn, vn = rand(rng, (2, 4, 1, 16), "float32"), rand(rng, (2, 4, 1, 16), "float32")
    out = cubeattn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=21, causal=True, window_size=(6, 0),
                                           softmax_scale=0.2)
    ref, _ = ref_rows(f64(q), f64(kc), f64(vc), [0, 0], [25, 25], True, (6, 0), 0.2)
    assert rel_err(out, ref) <= 1e-5
    # no cache_seqlens and no new keys: the whole cache
    out = cubeattn.flash_attn_with_kvcache(q, kc, vc)
    ref, _ = ref_rows(f64(q), f64(kc), f64(vc), [0, 0], [40, 40], False)
    assert rel_err(out, ref) <= 1e-5


def paged_case(rng, page, lens, new, num_pages, hkv=2, d=16, dtype="float32", share=False):
    """A paged cache: logical rows [B, blocks * page] scattered into `num_pages` pages by a random
    table (distinct pages; with `share`, row 1 starts with row 0's first page)."""
    b = len(lens)
    blocks = -(-(max(lens) + new) // page)
    cap = blocks * page
    logical_k, logical_v = rand(rng, (b, cap, hkv, d), dtype), rand(rng, (b, cap, hkv, d), dtype)
    table = rng.permutation(num_pages)[:b * blocks].reshape(b, blocks).astype(np.int32)
    if share:
        table[1, 0] = table[0, 0]
        logical_k[1, :page], logical_v[1, :page] = logical_k[0, :page], logical_v[0, :page]
    pool_k, pool_v = to_pages(logical_k, table, num_pages), to_pages(logical_v, table, num_pages)
    return logical_k, logical_v, table, pool_k, pool_v


@pytest.mark.parametrize("page, share, leftpad, window, in_place", [
    (64, False, False, (-1, -1), True), (128, False, False, (-1, -1), True), (256, False, True, (-1, -1), False),
    (16, False, False, (-1, -1), False), (64, True, False, (-1, -1), False), (64, False, False, (20, 0), False),
    (64, False, "aligned", (-1, -1), True)])
@pytest.mark.parametrize("new", [0, 2])
def test_paged_kvcache(page, share, leftpad, window, in_place, new, monkeypatch):
    rng = np.random.default_rng(page + new)
    lens = np.array([70, 200 if page < 256 else 300, 1], np.int32)
    num_pages = 3 * (-(-(lens.max() + new) // page) + 1) + 3
    lk, lv, table, pk, pv = paged_case(rng, page, lens, new, num_pages, share=share)
    b, sq, hq = 3, max(new, 1), 4
    q = rand(rng, (b, sq, hq, 16), "float32")
    kn, vn = rand(rng, (b, new, 2, 16), "float32"), rand(rng, (b, new, 2, 16), "float32")
    pad = {False: None, True: np.array([3, 77, 0], np.int32), "aligned": np.array([64, 128, 0], np.int32)}[leftpad]
    paths = []
    real = _kvcache.paged_keys

    def spy(*a):
        res = real(*a)
        paths.append(res[1] is not None)
        return res

    monkeypatch.setattr(_kvcache, "paged_keys", spy)
    out = cubeattn.flash_attn_with_kvcache(q, pk, pv, kn if new else None, vn if new else None,
                                           cache_seqlens=lens, cache_leftpad=pad, block_table=table, causal=True,
                                           window_size=window)
    assert paths == [in_place]
    for r in range(b):
        lk[r, lens[r]:lens[r] + new], lv[r, lens[r]:lens[r] + new] = kn[r], vn[r]
    assert np.array_equal(from_pages(pk, table), lk) and np.array_equal(from_pages(pv, table), lv)
    starts = np.zeros(b, np.int64) if pad is None else pad
    ref, _ = ref_rows(f64(q), f64(lk), f64(lv), starts, lens + new, True, window)
    assert rel_err(out, ref) <= 1e-5


def test_kvcache_torch_in_place_and_no_grad():
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(3)
    q = torch.rand(2, 1, 4, 16, generator=gen, requires_grad=True)
    kc, vc = torch.rand(2, 64, 2, 16, generator=gen), torch.rand(2, 64, 2, 16, generator=gen)
    kn, vn = torch.rand(2, 1, 2, 16, generator=gen), torch.rand(2, 1, 2, 16, generator=gen)
    seqlens = torch.tensor([10, 63], dtype=torch.int32)
    out = cubeattn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=True)
    assert isinstance(out, torch.Tensor) and not out.requires_grad
    assert torch.equal(kc[0, 10], kn[0, 0]) and torch.equal(vc[1, 63], vn[1, 0])
    ref, _ = ref_rows(f64(q), f64(kc), f64(vc), [0, 0], [11, 64], True)
    assert rel_err(f64(out), ref) <= 1e-5


@pytest.mark.parametrize("page", [64, 16])
def test_varlen_block_table_forward_and_grads(page):
    """flash_attn_varlen_func(block_table=...): a paged k, v; torch autograd gives dk, dv in the
    paged layout."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    lens_q, lens_k = np.array([5, 40, 1]), np.array([70, 130, 9])
    num_pages = 3 * (-(-lens_k.max() // page) + 1) + 2
    lk, lv, table, pk, pv = paged_case(rng, page, lens_k, 0, num_pages)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = torch.tensor(rand(rng, (int(cu_q[-1]), 4, 16), "float32"), requires_grad=True)
    k, v = (torch.tensor(x, requires_grad=True) for x in (pk, pv))
    out = cubeattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 40, 130, causal=True, block_table=table)
    dout = rand(rng, tuple(out.shape), "float32")
    out.backward(torch.tensor(dout))
    flat_k = np.concatenate([lk[r, :lens_k[r]] for r in range(3)])
    flat_v = np.concatenate([lv[r, :lens_k[r]] for r in range(3)])
    segs = [(int(cu_q[r]), int(lens_q[r]), int(cu_k[r]), int(lens_k[r])) for r in range(3)]
    ref, _ = ref_attention(f64(q), f64(flat_k), f64(flat_v), segs, True)
    assert rel_err(f64(out), ref) <= 1e-5
    dq, dk, dv = ref_backward(f64(q), f64(flat_k), f64(flat_v), dout, segs, True)
    assert rel_err(f64(q.grad), dq) <= BWD_TOL["float32"][1]
    for got, want in ((k.grad, dk), (v.grad, dv)):
        logical = np.zeros(lk.shape)
        for r in range(3):
            logical[r, :lens_k[r]] = want[cu_k[r]:cu_k[r + 1]]
        assert rel_err(f64(got), to_pages(logical, table, num_pages)) <= BWD_TOL["float32"][1]


def test_kvcache_bad_arguments_name_them():
    rng = np.random.default_rng(5)
    q = rand(rng, (2, 1, 4, 16), "float32")
    kc = rand(rng, (2, 8, 2, 16), "float32")
    kn = rand(rng, (2, 1, 2, 16), "float32")
    call = cubeattn.flash_attn_with_kvcache
    with pytest.raises(NotImplementedError, match="rotary_cos"):
        call(q, kc, kc.copy(), kn, kn.copy(), rotary_cos=np.ones((8, 8)), rotary_sin=np.ones((8, 8)), cache_seqlens=0)
    with pytest.raises(NotImplementedError, match="softcap"):
        call(q, kc, kc.copy(), softcap=5.0)
    with pytest.raises(ValueError, match="cache_seqlens"):
        call(q, kc, kc.copy(), kn, kn.copy(), cache_seqlens=8)  # no room for the new key
    with pytest.raises(ValueError, match="cache_seqlens"):
        call(q, kc, kc.copy(), kn, kn.copy())
    with pytest.raises(ValueError, match="`v`"):
        call(q, kc, kc.copy(), kn, None, cache_seqlens=1)
    with pytest.raises(ValueError, match="cache_batch_idx"):
        call(q, kc, kc.copy(), cache_batch_idx=np.array([0, 2], np.int32))
    with pytest.raises(ValueError, match="cache_seqlens"):
        call(q, kc, kc.copy(), cache_seqlens=np.array([1, 2, 3], np.int32))
    with pytest.raises(TypeError, match="`k`"):
        call(q, kc, kc.copy(), kn.astype(np.float16), kn.astype(np.float16), cache_seqlens=0)
    pool = rand(rng, (4, 64, 2, 16), "float32")
    with pytest.raises(ValueError, match="block_table"):  # 100 keys need two blocks, the table has one
        call(q, pool, pool.copy(), cache_seqlens=np.array([100, 3], np.int32), block_table=np.array([[0], [1]], np.int32))
    before = pool.copy()
    with pytest.raises(ValueError, match="block_table"):  # checked before the new key is written through it
        call(q, pool, pool.copy(), kn, kn.copy(), cache_seqlens=3, block_table=np.array([[0], [9]], np.int32))
    assert np.array_equal(pool, before)
    with pytest.raises(ValueError, match="cache_batch_idx"):
        call(q, pool, pool.copy(), cache_seqlens=3, block_table=np.array([[0], [1]], np.int32),
             cache_batch_idx=np.array([0, 1], np.int32))
    with pytest.raises(ValueError, match="cache_leftpad"):
        call(q, kc, kc.copy(), cache_seqlens=2, cache_leftpad=np.array([3, 0], np.int32))


def _count_validating(monkeypatch):
    """Fresh fast-path caches, and a list that grows by one per call of the validating path."""
    monkeypatch.setattr(_kvcache, "_SEEN", {})
    monkeypatch.setattr(_kvcache, "_DSPEC", {})
    calls, real = [], _kvcache._general

    def spy(*a):
        calls.append(1)
        return real(*a)

    monkeypatch.setattr(_kvcache, "_general", spy)
    return calls


def _decode_steps(kind, new, lens, want_lse, window, seed):
    """A decode loop of plain calls (no cache_batch_idx / leftpad / block_table) on fresh copies
    of one cache: each step's outputs and the caches after it. Key counts grow, and one step
    repeats the one before (the fast path's spec cache is hit and missed)."""
    rng = np.random.default_rng(seed)
    b, hq, hkv, d, rows, cap = 3, 4, 2, 16, 4, 40  # the cache holds one row more than the batch
    sq = max(new, 1)
    q = rand(rng, (b, sq, hq, d), "float16")
    kc, vc = rand(rng, (rows, cap, hkv, d), "float16"), rand(rng, (rows, cap, hkv, d), "float16")
    news = [(rand(rng, (b, new, hkv, d), "float16"), rand(rng, (b, new, hkv, d), "float16")) for _ in range(5)]
    wrap = (lambda x: x) if kind == "numpy" else __import__("torch").from_numpy
    q, kc, vc = wrap(q), wrap(kc), wrap(vc)
    out = []
    for step, base in enumerate([3, 7, 7, 12, 20]):
        per_row = np.array([base, base + 5, base + 1], np.int32)
        seqlens = {"int": base, "none": None, "uniform": wrap(np.full(b, base, np.int32)),
                   "ragged": wrap(per_row), "ragged64": wrap(per_row.astype(np.int64))}[lens]
        kn, vn = (wrap(x) for x in news[step]) if new else (None, None)
        res = cubeattn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=True,
                                               window_size=window, return_softmax_lse=want_lse)
        out.append(res if want_lse else (res,))
    return out, kc, vc


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("lens", ["int", "none", "uniform", "ragged", "ragged64"])
@pytest.mark.parametrize("new", [0, 1, 2])
@pytest.mark.parametrize("want_lse, window", [(False, (-1, -1)), (True, (-1, -1)), (True, (4, 0))])
def test_kvcache_fast_path_is_the_validating_path(kind, lens, new, want_lse, window, monkeypatch):
    """Repeats of a plain call shape skip the validating path (`_kvcache._plain_call`): outputs,
    lse and the caches written in place must be exactly the validating path's (FAST off), step
    after step."""
    if kind == "torch":
        pytest.importorskip("torch")
    if lens == "none" and new:
        pytest.skip("appending needs cache_seqlens")
    calls = _count_validating(monkeypatch)
    fast = _decode_steps(kind, new, lens, want_lse, window, seed=7 + new)
    assert len(calls) == 1  # the first step only: the others took the fast path
    monkeypatch.setattr(_kvcache, "FAST", False)
    slow = _decode_steps(kind, new, lens, want_lse, window, seed=7 + new)
    assert len(calls) == 6
    (fo, fk, fv), (so, sk, sv) = fast, slow
    assert np.array_equal(f64(fk), f64(sk)) and np.array_equal(f64(fv), f64(sv))
    for got, want in zip(fo, so):
        for g, w in zip(got, want):
            assert type(g) is type(w) and tuple(g.shape) == tuple(w.shape) and g.dtype == w.dtype
            assert np.array_equal(f64(g), f64(w))
            if kind == "torch":
                assert not g.requires_grad


def test_kvcache_fast_path_errors_are_the_validating_paths(monkeypatch):
    """After a shape has been served, bad per-call values still raise the validating path's
    exception (type and message, naming the argument), and nothing is appended first."""
    calls = _count_validating(monkeypatch)
    rng = np.random.default_rng(9)
    q = rand(rng, (2, 1, 4, 16), "float32")
    kc, vc = rand(rng, (2, 8, 2, 16), "float32"), rand(rng, (2, 8, 2, 16), "float32")
    kn, vn = rand(rng, (2, 1, 2, 16), "float32"), rand(rng, (2, 1, 2, 16), "float32")
    call = cubeattn.flash_attn_with_kvcache
    call(q, kc, vc, kn, vn, cache_seqlens=3)
    call(q, kc, vc, cache_seqlens=3)
    assert len(calls) == 2 and len(_kvcache._SEEN) == 2
    bad = [dict(cache_seqlens=8), dict(cache_seqlens=-1), dict(cache_seqlens=np.array([1, 8], np.int32)),
           dict(cache_seqlens=np.array([1, -2], np.int32)), dict(cache_seqlens=np.array([1, 2, 3], np.int32)),
           dict(cache_seqlens=np.array([1.0, 2.0])), dict(cache_seqlens=True), dict(cache_seqlens=None)]
    for kw in bad:
        errors = []
        for fast in (True, False):
            monkeypatch.setattr(_kvcache, "FAST", fast)
            before = kc.copy()
            with pytest.raises((ValueError, TypeError)) as e:
                call(q, kc, vc, kn, vn, **kw)
            assert np.array_equal(kc, before)
            assert "cache_seqlens" in str(e.value)
            errors.append((type(e.value), str(e.value)))
        assert errors[0] == errors[1], kw
    monkeypatch.setattr(_kvcache, "FAST", True)
    for kw in (dict(cache_seqlens=9), dict(cache_seqlens=np.array([0, 9], np.int32))):  # no new keys: 8 at most
        with pytest.raises(ValueError, match="cache_seqlens"):
            call(q, kc, vc, **kw)
